"""OpenAI-compatible gateway in front of vLLM that emits one trace event per request.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (plain and
``stream: true`` SSE) are proxied to vLLM with the public model name rewritten
to the served one (``resolve_model``); ``GET /v1/models`` lists the public
names; ``POST /v1/feedback`` publishes a feedback event; ``GET /healthz`` and
``GET /metrics`` (Prometheus) serve operations.

Only the first choice (index 0) of a response is traced (``n > 1`` traces choice 0),
and completions with a batch of prompts or token-id prompts are served but not traced.

Every proxied response carries the header ``x-hourglass-trace-id`` (uuid4 hex).
The trace event (DESIGN.md §4) is published after the response body is
produced, through :class:`~connectors.gateway_publish.EventPublisher`, so Kafka
never slows or fails the client. Errors use the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``.

Upstream API: OpenAI Chat Completions / Completions (as served by vLLM 0.32).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.background import BackgroundTask

from connectors.config import BufferConfig, KafkaConfig
from connectors.gateway_publish import TRACE_ERRORS, EventPublisher
from connectors.gateway_trace import (
    ClientAsked,
    Completion,
    Endpoint,
    build_trace,
    strip_extras,
    upstream_body,
)
from connectors.schema import FeedbackEvent, UserHasher
from connectors.sink import TraceSink

log = logging.getLogger(__name__)

TRACE_HEADER = "x-hourglass-trace-id"
REQUESTS = Counter("hourglass_gateway_requests", "Gateway requests by endpoint and HTTP status.", ["endpoint", "status"])

ResolveModel = Callable[[str], tuple[str, str | None]]


class FeedbackIn(BaseModel):
    """Body of ``POST /v1/feedback``: the trace it is about and at least one signal."""

    model_config = ConfigDict(extra="forbid")

    trace_id: str = Field(min_length=1, max_length=256, description="The x-hourglass-trace-id of the response.")
    thumbs: Any = Field(default=None, description='"up" or "down".')
    rating: int | None = Field(default=None, ge=1, le=5, description="Star rating 1..5.")
    reward: float | None = Field(default=None, allow_inf_nan=False, description="Explicit scalar reward (finite).")
    edited: bool | None = None
    regenerated: bool | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _checks(self) -> FeedbackIn:
        if self.thumbs is not None and self.thumbs not in ("up", "down"):
            raise ValueError(f'thumbs must be "up" or "down", got {self.thumbs!r}')
        if all(getattr(self, k) is None for k in ("thumbs", "rating", "reward", "edited", "regenerated")):
            raise ValueError("give at least one signal: thumbs, rating, reward, edited or regenerated")
        return self


def openai_error(status: int, message: str, *, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """An error response in the OpenAI format."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def create_gateway_app(
    kafka: KafkaConfig,
    upstream_url: str,
    resolve_model: ResolveModel,
    *,
    sink: TraceSink | None = None,
    list_models: Callable[[], Iterable[str]] | None = None,
    user_hasher: UserHasher | None = None,
    timeout_s: float = 600.0,
    feedback_timeout_s: float = 15.0,
) -> FastAPI:
    """Build the gateway app.

    Args:
        kafka: where trace/feedback events go (the topics must exist; see ``kafka_admin.ensure_topics``).
        upstream_url: vLLM base URL, e.g. ``http://127.0.0.1:18000`` (no ``/v1``).
        resolve_model: public model name -> ``(vLLM served name, adapter version or None for the base)``;
            raises ``LookupError`` (``KeyError``) for an unknown name (the client gets 404). When it also has a
            ``route(public, routing_key) -> (served, version, canary)`` method (a canary split), that is called
            with the hashed ``user`` (else the trace id) as the routing key, and a non-None ``canary`` is written
            to the trace's ``metadata.canary``.
        sink: publish through this sink (caller closes it); None = the gateway creates and closes its own,
            retrying while the broker is unreachable.
        list_models: the public names for ``GET /v1/models`` (default: none).
        user_hasher: hashes the request's ``user`` and user ids in its ``metadata``
            (default: keyed with ``BufferConfig()`` defaults; pass the configured one).
        timeout_s: upstream read timeout, seconds. feedback_timeout_s: how long feedback waits for the broker ack.

    The resources (httpx client, publisher thread) live in the app's lifespan: serve the app with an
    ASGI server that runs lifespan events (uvicorn does).
    """
    hasher = user_hasher or UserHasher(BufferConfig().user_hash_key.get_secret_value(), BufferConfig().user_id_keys)
    base = upstream_url.rstrip("/")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.client = httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(timeout_s, connect=10.0))
        app.state.publisher = EventPublisher(kafka, sink)
        try:
            yield
        finally:
            # Shutdown order: 1. uvicorn has stopped taking requests, 2. close upstream connections,
            # 3. publish what is queued and close an owned sink (off the event loop).
            await app.state.client.aclose()
            await asyncio.to_thread(app.state.publisher.close)

    app = FastAPI(title="Hourglass gateway", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in err.errors())
        REQUESTS.labels(request.url.path, "422").inc()
        return openai_error(422, f"invalid request: {problems}", type_="invalid_request_error")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = list(list_models()) if list_models is not None else []
        REQUESTS.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "hourglass"} for n in names]}

    @app.post("/v1/feedback")
    async def feedback(body: FeedbackIn) -> JSONResponse:
        data = body.model_dump(exclude_none=True)
        data["metadata"] = hasher(data.get("metadata") or {})
        data["ts"] = datetime.now(UTC)  # when the feedback was given
        event = FeedbackEvent.model_validate(data)
        loop = asyncio.get_running_loop()
        acked: asyncio.Future[Exception | None] = loop.create_future()

        def on_done(err: Exception | None) -> None:
            loop.call_soon_threadsafe(lambda: acked.done() or acked.set_result(err))

        app.state.publisher.publish_feedback(event, on_done)
        try:
            err = await asyncio.wait_for(acked, feedback_timeout_s)
        except TimeoutError:
            err = TimeoutError(f"no broker acknowledgement within {feedback_timeout_s}s")
        if err is not None:
            REQUESTS.labels("/v1/feedback", "503").inc()
            return openai_error(503, f"feedback for trace {body.trace_id!r} was not stored: {err}; retry later",
                                type_="service_unavailable")  # fmt: skip
        REQUESTS.labels("/v1/feedback", "200").inc()
        return JSONResponse({"trace_id": body.trace_id, "status": "stored"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _proxy(app, request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _proxy(app, request, "completions", "/v1/completions")

    async def _proxy(app: FastAPI, request: Request, endpoint: Endpoint, path: str) -> Response:
        response = await _proxy_inner(app, request, endpoint, path)
        REQUESTS.labels(path, str(response.status_code)).inc()
        return response

    async def _proxy_inner(app: FastAPI, request: Request, endpoint: Endpoint, path: str) -> Response:
        started = time.perf_counter()
        try:
            body = json.loads(await request.body())
        except ValueError as err:
            return openai_error(400, f"request body is not valid JSON: {err}", type_="invalid_request_error")
        if not isinstance(body, dict):
            return openai_error(400, f"request body must be a JSON object, got {type(body).__name__}", type_="invalid_request_error")
        public = body.get("model")
        if not isinstance(public, str) or not public:
            return openai_error(400, "field 'model' is required (a public model name, see GET /v1/models)",
                                type_="invalid_request_error", param="model")  # fmt: skip
        meta = body.get("metadata")
        if meta is not None and not isinstance(meta, dict):
            return openai_error(400, f"field 'metadata' must be an object, got {type(meta).__name__}",
                                type_="invalid_request_error", param="metadata")  # fmt: skip
        trace_id = uuid.uuid4().hex
        route = getattr(resolve_model, "route", None)  # a canary-aware resolver also takes the routing key
        routing_key = hasher.digest(body["user"]) if body.get("user") is not None else trace_id
        try:
            served, version, canary = route(public, routing_key) if route is not None else (*resolve_model(public), None)
        except LookupError:
            return openai_error(404, f"The model `{public}` does not exist; ask GET /v1/models for the served names",
                                type_="invalid_request_error", param="model", code="model_not_found")  # fmt: skip
        if canary is not None:  # the trace records whether the challenger answered (set here, not by the client)
            body = {**body, "metadata": {**(meta or {}), "canary": canary}}
        asked = ClientAsked.of(endpoint, body)
        stream = bool(body.get("stream"))
        headers = {"content-type": "application/json"}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        client: httpx.AsyncClient = app.state.client
        try:
            upstream_request = client.build_request("POST", path, json=upstream_body(endpoint, body, served), headers=headers)
        except UnicodeEncodeError as err:  # e.g. a lone surrogate ("\ud800") in a message: not encodable as UTF-8
            return openai_error(400, f"request body has text that is not valid Unicode: {err.reason} at position {err.start}",
                                type_="invalid_request_error")  # fmt: skip
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.TransportError as err:
            return openai_error(502, f"upstream vLLM at {base} is unreachable: {type(err).__name__}: {err}; is it running?",
                                type_="upstream_error", code="upstream_unreachable")  # fmt: skip
        trace_headers = {TRACE_HEADER: trace_id}
        if upstream.status_code >= 400 or not stream:
            try:
                raw = await upstream.aread()
            except httpx.TransportError as err:
                return openai_error(502, f"upstream vLLM at {base} failed mid-response: {err}", type_="upstream_error")
            finally:
                await upstream.aclose()
            if upstream.status_code >= 400:
                media = upstream.headers.get("content-type", "application/json")
                return Response(raw, status_code=upstream.status_code, media_type=media, headers=trace_headers)
            try:
                payload = json.loads(raw)
            except ValueError:
                return openai_error(502, f"upstream vLLM at {base} answered with a body that is not JSON: {raw[:200]!r}",
                                    type_="upstream_error")  # fmt: skip
            completion = Completion()
            completion.add_payload(endpoint, payload, delta=False)
            strip_extras(payload, asked)
            task = BackgroundTask(publish, app, trace_id, endpoint, body, public, served, version, completion, False, started)
            return JSONResponse(payload, headers=trace_headers, background=task)

        return StreamingResponse(
            _relay(app, upstream, asked, trace_id, endpoint, body, public, served, version, started),
            media_type="text/event-stream",
            headers=trace_headers,
        )

    async def _relay(
        app: FastAPI, upstream: httpx.Response, asked: ClientAsked, trace_id: str, endpoint: Endpoint,
        body: dict[str, Any], public: str, served: str, version: str | None, started: float,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """Pass SSE lines through (extras stripped) while assembling the completion.

        The trace is published when ``[DONE]`` arrives, before that line is passed on:
        a client that hangs up as soon as it reads ``[DONE]`` (the openai client does)
        makes the server cancel this generator, and nothing after the last ``yield``
        would run.
        """
        completion = Completion()
        errored = False
        try:
            async for line in upstream.aiter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    if data == "[DONE]":
                        if not errored:
                            publish(app, trace_id, endpoint, body, public, served, version, completion, True, started)
                    else:
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            chunk = None
                        if isinstance(chunk, dict):
                            if "error" in chunk:
                                errored = True
                                log.warning("gateway: upstream stream error for trace %s: %s", trace_id, chunk["error"])
                            completion.add_payload(endpoint, chunk, delta=True)
                            line = "data: " + json.dumps(strip_extras(chunk, asked), separators=(",", ":"))
                yield (line + "\n").encode()
        except httpx.TransportError as err:
            log.warning("gateway: upstream stream for trace %s broke: %s", trace_id, err)
        finally:
            await upstream.aclose()

    def publish(
        app: FastAPI, trace_id: str, endpoint: Endpoint, body: dict[str, Any], public: str, served: str,
        version: str | None, completion: Completion, stream: bool, started: float,
    ) -> None:  # fmt: skip
        """Build the trace event and queue it (non-blocking); a bad event is logged and counted, never raised."""
        user = body.get("user")
        traced = {**body, "metadata": hasher(body.get("metadata") or {})}
        try:
            event = build_trace(
                trace_id=trace_id, endpoint=endpoint, body=traced, public_name=public, served_name=served,
                adapter_version=version, completion=completion, stream=stream,
                latency_ms=(time.perf_counter() - started) * 1000.0,
                user_hash=hasher.digest(user) if user is not None else None,
            )  # fmt: skip
        except ValidationError as err:
            TRACE_ERRORS.inc()
            log.error("gateway: trace %s is not a valid trace event: %s", trace_id, err)
            return
        if event is None:
            log.info("gateway: trace %s not published (batch or token-id prompt)", trace_id)
            return
        app.state.publisher.publish_trace(event)

    return app


def serve_gateway(app: FastAPI, host: str, port: int, *, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn on ``host:port`` until interrupted (runs the lifespan: publisher, client)."""
    uvicorn.run(app, host=host, port=port, log_level=log_level)
