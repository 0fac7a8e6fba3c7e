"""A recording fake upstream (an OpenAI-shaped server on a real socket) and a recording trace sink,
so the real gateway app can be attacked without Kafka and with proof of what reached the model server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from connectors.schema import FeedbackEvent, TraceEvent

from tests.http_helpers import serve as http_serve


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


serve = http_serve  # the app on a free port (tests/http_helpers.py)


def _completion(model: str) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "4"},
                "finish_reason": "stop",
                "logprobs": {"content": [{"token": "4", "logprob": -0.1}]},
                "token_ids": [19],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


class FakeUpstream:
    """Records every request (headers and JSON body). A body whose first message is ``"slow"`` makes it
    generate for ``slow_s`` seconds (a stream: one chunk per 0.1 s), recording ``"disconnected"`` /
    ``"cancelled"`` when the gateway goes away before the end, ``"finished"`` otherwise."""

    def __init__(self, slow_s: float = 20.0) -> None:
        self.requests: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.slow_s = slow_s
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._chat)

    async def _chat(self, request: Request) -> Any:
        body = await request.json()
        self.requests.append({"headers": dict(request.headers), "body": body})
        slow = (body.get("messages") or [{}])[0].get("content") == "slow"
        if body.get("stream"):
            return StreamingResponse(self._stream(body, slow), media_type="text/event-stream")
        if slow:
            deadline = time.monotonic() + self.slow_s
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    self.events.append("disconnected")
                    return JSONResponse({})
                await asyncio.sleep(0.05)
            self.events.append("finished")
        return JSONResponse(_completion(body["model"]))

    async def _stream(self, body: dict[str, Any], slow: bool):
        import json

        steps = int(self.slow_s / 0.1) if slow else 1
        try:
            for _ in range(steps):
                chunk = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": "x"},
                            "token_ids": [7],
                            "logprobs": {"content": [{"token": "x", "logprob": -0.5}]},
                            "finish_reason": None,
                        }
                    ],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0.1 if slow else 0)
            yield "data: [DONE]\n\n"
            self.events.append("finished")
        except (asyncio.CancelledError, GeneratorExit):
            self.events.append("cancelled")
            raise


class FakeSink:
    """A TraceSink stand-in: records what the gateway publishes and acknowledges at once."""

    def __init__(self) -> None:
        self.traces: list[TraceEvent] = []
        self.feedback: list[FeedbackEvent] = []

    def send_trace(self, event: TraceEvent, on_done: Callable[[Exception | None], None]) -> None:
        self.traces.append(event)
        on_done(None)

    def send_feedback(self, event: FeedbackEvent, on_done: Callable[[Exception | None], None]) -> None:
        self.feedback.append(event)
        on_done(None)

    def trace(self, trace_id: str) -> TraceEvent:
        return wait_for(lambda: next((t for t in self.traces if t.trace_id == trace_id), None), 10, f"trace {trace_id}")
