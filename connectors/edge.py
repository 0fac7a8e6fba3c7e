"""The HTTP edge of the gateway and the ops API: limits on the request head, enforced by the server
while it reads the bytes, before any application code (authentication included) runs.

Both servers run uvicorn with its h11 protocol and :class:`EdgeH11Protocol`, a thin subclass that adds
what uvicorn lacks (see docs/security.md, "The HTTP edge", for the choice):

- **header block size**: h11's ``max_incomplete_event_size`` (uvicorn's ``h11_max_incomplete_event_size``)
  stops buffering a request line + headers past ``max_header_bytes``; a head that arrived whole in one
  read is measured too. Beyond the cap: ``431 Request Header Fields Too Large`` and the connection closes.
- **header count**: more than ``max_headers`` header lines: 431.
- **header timeout**: a request head that is not complete ``header_timeout_s`` seconds after the connection
  opened (or after the previous response on a keep-alive connection) closes the connection (with a
  ``408`` when part of a request had arrived). uvicorn's ``timeout_keep_alive`` is no such limit: any byte
  received resets it, so a client trickling one byte a second holds a connection for ever.
- **one reading of the head**: more than one ``Host``, ``Content-Length``, ``Transfer-Encoding``,
  ``Content-Type``, ``Authorization``, ``Origin`` or ``Sec-Fetch-Site`` header, or both ``Transfer-Encoding``
  and ``Content-Length`` (request smuggling through a proxy that frames the body by the other), is a 400.
- **request target**: only origin-form (``/path?query``), and ``*`` for ``OPTIONS``: an absolute-form
  target (``GET http://evil.example/status``, RFC 9112 section 3.2.2, meant for proxies) is a 400, so no
  route ever reads a host from the target instead of the checked ``Host`` header.

Every refusal here is ``text/plain`` with ``connection: close``, written before the application sees the
request. Source: RFC 9112 (HTTP/1.1 message syntax), RFC 6585 section 5 (431), h11 0.16.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

_PHRASES = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
# Headers a request may carry once: two of them are read differently by different parsers (and by a proxy).
SINGLE_HEADERS = (
    b"host",
    b"content-length",
    b"transfer-encoding",
    b"content-type",
    b"authorization",
    b"origin",
    b"sec-fetch-site",
)


@dataclass(frozen=True)
class EdgeLimits:
    """Limits on one request head (``gateway.*`` / ``api.*`` fields of the same names).

    Attributes:
        max_header_bytes: longest request line + header block, bytes.
        max_headers: most header lines in one request.
        header_timeout_s: longest wait for a complete request head, seconds.
    """

    max_header_bytes: int = 65_536
    max_headers: int = 100
    header_timeout_s: float = 10.0


class HeadRefused(h11.RemoteProtocolError):
    """A request head beyond :class:`EdgeLimits`, or with a target that is not origin-form."""


class _GuardedConnection(h11.Connection):
    """h11's server connection that also checks every parsed request head against the limits, records the
    error it raised (for its status code) and reports when a head is complete (to stop the header timer)."""

    def __init__(self, limits: EdgeLimits, on_head: Any) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.limits, self.on_head = limits, on_head
        self.refusal: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as err:
            self.refusal = err
            raise
        if isinstance(event, h11.Request):
            self.on_head()
            try:
                self._check(event)
            except HeadRefused as err:
                self.refusal = err
                raise
        return event

    def _check(self, event: h11.Request) -> None:
        limits = self.limits
        if len(event.headers) > limits.max_headers:
            raise HeadRefused(
                f"{len(event.headers)} header lines, above the limit of {limits.max_headers}", error_status_hint=431
            )
        size = len(event.method) + len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers) + 13
        if size > limits.max_header_bytes:  # a head that arrived whole in one read is never "incomplete"
            raise HeadRefused(
                f"the request head is {size} bytes, above the limit of {limits.max_header_bytes} bytes",
                error_status_hint=431,
            )
        names = [name for name, _ in event.headers]  # h11 lowercases header names
        for name in SINGLE_HEADERS:
            if names.count(name) > 1:  # the app reads the first, a proxy in front may read the last: never guess
                raise HeadRefused(
                    f"{names.count(name)} {name.decode()} headers: send exactly one", error_status_hint=400
                )
        if b"transfer-encoding" in names and b"content-length" in names:  # RFC 9112 section 6.3: request smuggling
            raise HeadRefused(
                "both Transfer-Encoding and Content-Length: send one (a proxy in front may frame the body by the other)",
                error_status_hint=400,
            )
        target = event.target
        if not (target.startswith(b"/") or (target == b"*" and event.method == b"OPTIONS")):
            raise HeadRefused(
                "the request target must be a path (origin-form, e.g. /status), not "
                f"{target[:60].decode('ascii', 'replace')!r}",
                error_status_hint=400,
            )


class EdgeH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with :class:`EdgeLimits` (a subclass per limits is made by :func:`server_config`)."""

    limits: EdgeLimits = EdgeLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guarded = _GuardedConnection(self.limits, self._head_complete)
        self.conn = self.guarded
        self._head_timer: asyncio.TimerHandle | None = None

    # --- the header timer: armed while the server waits for a request head ------------------------

    def _arm(self) -> None:
        self._head_complete()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def _head_complete(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        partial, _ = self.conn.trailing_data
        if partial and self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:  # part of a head
            self.logger.info("closing a connection whose request head took over %gs", self.limits.header_timeout_s)
            msg = f"the request head was not received within {self.limits.header_timeout_s:g} s"
            self._write_refusal(408, msg)
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_complete()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # the next request's head is due within the timeout (a pipelined one disarms it at once)
        super().on_response_complete()

    # --- refusals ------------------------------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """uvicorn answers every h11 error with a 400; answer with h11's status hint (431 for a head too
        large) and the reason instead."""
        err = self.guarded.refusal
        status = err.error_status_hint if err is not None and err.error_status_hint in _PHRASES else 400
        reason = str(err) if err is not None and str(err) else msg
        self._write_refusal(status, reason)
        self.transport.close()

    def _write_refusal(self, status: int, msg: str) -> None:
        body = msg.encode("ascii", "replace")
        head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % (status, _PHRASES[status], len(body))
        )
        self.transport.write(head + body)  # raw: h11 may be in a state where it sends no response


def server_config(app: Any, host: str, port: int, limits: EdgeLimits, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config that serves ``app`` behind :class:`EdgeH11Protocol` with ``limits`` (h11 only; no
    WebSocket upgrades: neither server has a WebSocket route). ``kwargs`` go to :class:`uvicorn.Config`."""
    protocol = type("EdgeH11Protocol", (EdgeH11Protocol,), {"limits": limits})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        ws="none",
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **kwargs,
    )
