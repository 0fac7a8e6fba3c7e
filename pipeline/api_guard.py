"""The ops API's access rules, as one ASGI middleware that runs before any route (so before a body is
parsed: malformed JSON without a token is a 401, never a 422). The rules, in the order they are checked:

1. **Host** (DNS-rebinding defence): exactly one ``Host`` header (else 400) naming the API: an IP literal,
   127.0.0.1, localhost, ::1, ``api.host`` or one of ``api.allowed_hosts`` (else 421).
2. **Cross-site** (every state-changing call, i.e. any method but GET/HEAD): refused with 403 when the
   browser says the request comes from another site or origin: ``Sec-Fetch-Site: cross-site`` or
   ``same-site``, or an ``Origin`` that is not this API's own (``null`` included).
3. **Token**: state-changing calls need ``Authorization: Bearer <token>`` (missing 401, wrong 403). HTTP
   Basic credentials, which a browser caches and re-sends on its own, to any request to this origin,
   also a form another site submits, are accepted for reading the status page only: on a state-changing
   call they are a 401. When ``api.host`` is not a loopback address, reads need the token too (Bearer or
   Basic), except ``/healthz``, ``/metrics``, ``/readyz`` and the page's static files.
4. **Body** (state-changing calls): a form content type (``application/x-www-form-urlencoded``,
   ``multipart/form-data``, ``text/plain``: what a cross-site form can send without a CORS preflight) is a
   415; a body must be ``application/json`` in UTF-8 (415 otherwise), at most ``api.max_body_bytes``
   (413), arrive within ``api.body_timeout_s`` (408), and be one reading of JSON
   (:mod:`connectors.json_body`: no BOM, no UTF-16/32, unique keys, valid Unicode; 400 naming the problem).

Refusals are ``{"detail": "..."}`` like FastAPI's own. Request heads (size, header count, header timeout,
absolute-form targets) are limited earlier, by the server (:mod:`connectors.edge`).
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable
from urllib.parse import urlsplit

import anyio
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from connectors import json_body
from pipeline.console import presented_token

STATIC_PREFIX = "/console/static/"  # the status page's script and style sheet: no data, no secrets
OPEN_PATHS = frozenset({"/healthz", "/metrics", "/readyz"})  # readable without a token, whatever the bind address
FORM_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})
MAX_JSON_DEPTH = 32
PAGE_PATHS = ("/", "/console/")


def host_allowed(host_header: str | None, names: set[str]) -> bool:
    """True when the Host header (``name[:port]``) is an IP literal or one of ``names``."""
    if not host_header:
        return False
    host = host_header.strip(" \t").lower()  # HTTP whitespace only: "localhost\xa0" is another name
    if host.startswith("["):  # [::1]:8080; brackets hold an IPv6 literal only (RFC 3986 section 3.2.2)
        end = host.find("]")
        rest = host[end + 1 :] if end > 0 else ""
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isascii() and rest[1:].isdigit())):
            return False  # "[::1]evil" is no address: only a port may follow the bracket
        try:
            ipaddress.IPv6Address(host[1:end])
            return True
        except ValueError:
            return False  # "[localhost]" is no IPv6 literal
    if host.count(":") == 1:
        host, _, port = host.partition(":")
        if port and not (port.isascii() and port.isdigit()):
            return False  # "localhost:x": a port is digits, as after a bracket
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return host in names


def cross_site(origin: str | None, fetch_site: str | None, host: str | None) -> str | None:
    """Why a state-changing request comes from another site, or None: the browser's ``Sec-Fetch-Site``
    (``cross-site`` / ``same-site``; a page on another port of the same host is ``same-site``), or an
    ``Origin`` whose ``host[:port]`` is not the request's ``Host`` (``Origin: null`` included)."""
    site = (fetch_site or "").strip().lower()
    if site in ("cross-site", "same-site"):
        return f"Sec-Fetch-Site: {site}"
    if origin is None:
        return None  # not a browser (curl, the CLI), or an old one: the Bearer token rule still holds
    netloc = urlsplit(origin.strip()).netloc.lower() if "://" in origin else ""
    if not netloc or netloc != (host or "").strip().lower():
        return f"Origin {origin[:100]!r} is not this API's own"
    return None


def _refuse(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


class OpsGuard:
    """ASGI middleware enforcing the module's rules around the ops API app.

    Args:
        app: the FastAPI app.
        token: the API token (``api.token`` or the generated one).
        loopback: ``api.host`` is a loopback address (then reads need no token).
        names: Host header names the API answers to (``ApiConfig.host_names()``).
        max_body_bytes: largest body of a state-changing call (``api.max_body_bytes``).
        body_timeout_s: longest wait for that body (``api.body_timeout_s``).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: Callable[[], str],
        loopback: bool,
        names: set[str],
        max_body_bytes: int,
        body_timeout_s: float,
    ) -> None:
        self.app, self.token, self.loopback, self.names = app, token, loopback, names
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    def _token_state(self, request: Request, *, bearer_only: bool) -> str:
        """'ok', 'missing', 'wrong' or 'basic' (Basic credentials where only Bearer is accepted)."""
        scheme = request.headers.get("authorization", "").partition(" ")[0].lower()
        presented = presented_token(request)
        if not presented:
            return "missing"
        if bearer_only and scheme != "bearer":
            return "basic"
        return "ok" if secrets.compare_digest(presented.encode(), self.token().encode()) else "wrong"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = self._check_head(request)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if request.method not in ("GET", "HEAD"):
            body = await self._read_body(request, receive)
            if isinstance(body, JSONResponse):
                await body(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _check_head(self, request: Request) -> JSONResponse | None:
        """Host, cross-site and token rules (nothing read but the head); marks ``request.state.authenticated``."""
        hosts = [value for key, value in request.scope["headers"] if key == b"host"]  # ASGI names are lowercase
        if len(hosts) > 1:  # Starlette reads the first, a proxy or cache may read the last: refuse, never guess
            return _refuse(
                400, f"{len(hosts)} Host headers: send exactly one (the name or IP this API is addressed by)"
            )
        host = request.headers.get("host")
        if not host_allowed(host, self.names):
            return _refuse(
                421,
                "Host header not allowed: address the API by IP, localhost, api.host or a name in api.allowed_hosts",
            )
        mutation = request.method not in ("GET", "HEAD")
        path = request.url.path
        if mutation:
            why = cross_site(request.headers.get("origin"), request.headers.get("sec-fetch-site"), host)
            if why is not None:
                return _refuse(403, f"cross-site request refused ({why}): state-changing calls come from this origin")
            state = self._token_state(request, bearer_only=True)
            if state == "basic":
                return _refuse(
                    401,
                    "this call changes state: send the token as Authorization: Bearer <token>; Basic credentials "
                    "(what the browser caches for the status page) are accepted for reading only",
                    {"WWW-Authenticate": "Bearer"},
                )
            refusal = _token_refusal(state, "this call changes state")
            if refusal is None:
                problem = _content_type_problem(request)
                refusal = None if problem is None else _refuse(415, problem)
        elif not self.loopback and path not in OPEN_PATHS and not path.startswith(STATIC_PREFIX):
            state = self._token_state(request, bearer_only=False)
            if (path == "/" or path.startswith("/console/")) and state != "ok":
                # the status page in a browser: ask for the token as the Basic-auth password
                return _refuse(
                    401,
                    "this API is not on loopback: reads need the token too: the status page takes the API token "
                    "as the password (any user name)",
                    {"WWW-Authenticate": 'Basic realm="hourglass console"'},
                )
            refusal = _token_refusal(state, "this API is not on loopback: reads need the token too")
        else:  # an open read: details (e.g. /readyz's) only with the token off loopback
            state = "ok" if self.loopback else self._token_state(request, bearer_only=False)
            refusal = None
        request.state.authenticated = refusal is None and state == "ok"
        return refusal

    async def _read_body(self, request: Request, receive: Receive) -> bytes | JSONResponse:
        """The body of a state-changing call, checked (cap, timeout, one JSON reading), or the refusal."""
        declared = request.headers.get("content-length", "")
        too_big = _refuse(413, f"request body is larger than api.max_body_bytes={self.max_body_bytes} bytes")
        if declared.isascii() and declared.isdigit() and int(declared) > self.max_body_bytes:
            return too_big
        chunks: list[bytes] = []
        size = 0
        try:
            with anyio.fail_after(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return _refuse(400, "the client hung up before sending the whole body")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        return too_big
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return _refuse(408, f"request body not received within api.body_timeout_s={self.body_timeout_s:g} s")
        raw = b"".join(chunks)
        if raw:
            try:
                json_body.parse(raw, MAX_JSON_DEPTH)
            except json_body.JsonBodyError as err:
                return _refuse(err.status, err.message)
        return raw


def _token_refusal(state: str, what: str) -> JSONResponse | None:
    if state == "missing":
        return _refuse(401, f"{what}: send Authorization: Bearer <token>", {"WWW-Authenticate": "Bearer"})
    if state == "wrong":
        return _refuse(403, "wrong API token")
    return None


def _content_type_problem(request: Request) -> str | None:
    """Why the content type of a state-changing call is refused (a form type, or a body that is not JSON)."""
    content_type = request.headers.get("content-type")
    media = (content_type or "").split(";")[0].strip().lower()
    if media in FORM_TYPES:
        return (
            f"content type {media!r} is not accepted (it is what a form on another site can send); "
            "send application/json, or no body"
        )
    has_body = request.headers.get("content-length", "0").strip() not in ("", "0") or "transfer-encoding" in (
        request.headers
    )
    if content_type is None and not has_body:
        return None
    try:
        json_body.check_media_type(content_type)
    except json_body.JsonBodyError as err:
        return err.message
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then the client's later messages."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay
