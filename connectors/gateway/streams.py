"""Which streamed answers may take feedback: the gateway's memory of streams that are not complete.

A streamed response hands out its feedback token in the headers, before the
answer exists. Its trace is published only when the stream completes
(``[DONE]`` with no error chunk and no ``abort`` / ``error`` finish reason);
until then the trace id is *streaming*, and a stream that ends any other way
(the model server failed or cut the stream midway, an error chunk, the
client hung up) is *failed*: no trace is recorded, and ``/v1/feedback`` on
either refuses the token with a 409 instead of storing a vote that ingest
would only dead-letter as ``unmatched_feedback`` later.

The memory is per gateway process and bounded: a failed id is kept for the
feedback token's lifetime (after that the token itself is refused), at most
``max_failed`` of them (the oldest forgotten first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

StreamState = Literal["streaming", "failed"]
INCOMPLETE_FINISH = frozenset({"abort", "error"})  # vLLM's finish reasons of a generation that did not end


class StreamLedger:
    """Trace ids of streams in flight and of streams that failed (not thread-safe: the event loop's only).

    Args:
        ttl_s: how long a failed id is remembered, seconds (``gateway.feedback_token_ttl_s``).
        max_failed: most failed ids remembered.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, ttl_s: float, max_failed: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_failed, self._clock = ttl_s, max_failed, clock
        self._streaming: set[str] = set()
        self._failed: OrderedDict[str, float] = OrderedDict()  # trace id -> forget after (clock seconds)

    def start(self, trace_id: str) -> None:
        """A stream whose feedback token went out begins."""
        self._streaming.add(trace_id)

    def complete(self, trace_id: str) -> None:
        """The stream completed and its trace is published: feedback on it is welcome."""
        self._streaming.discard(trace_id)

    def end(self, trace_id: str) -> bool:
        """The response is over (however it ended); a stream that did not complete is now failed.
        Returns True when it failed."""
        if trace_id not in self._streaming:
            return False
        self._streaming.discard(trace_id)
        now = self._clock()
        while self._failed and (next(iter(self._failed.values())) <= now or len(self._failed) >= self.max_failed):
            self._failed.popitem(last=False)
        self._failed[trace_id] = now + self.ttl_s
        return True

    def state(self, trace_id: str) -> StreamState | None:
        """``streaming``, ``failed`` or None (a completed stream, an unstreamed answer, or forgotten)."""
        if trace_id in self._streaming:
            return "streaming"
        forget_at = self._failed.get(trace_id)
        return "failed" if forget_at is not None and forget_at > self._clock() else None
