"""The ops console: a status page served by the ops API.

| method | path | what |
| --- | --- | --- |
| GET | / | the status page (HTML) |
| GET | /console/panels | its refreshable part (HTML fragment; the page's script fetches it every 10 s) |
| GET | /console/data | the data behind the page (JSON) |
| GET | /console/static/* | the page's script and style sheet |

Viewing rule: when the API binds to a loopback address (``api.host``, the
default ``127.0.0.1``) the page is open to whoever can reach the port (only
this host); on any other address it needs the API token, either as
``Authorization: Bearer <token>`` or as the password of HTTP Basic auth (any
user name; the browser asks). The buttons always ask for the token and send it
as ``Authorization: Bearer`` to the existing endpoints.

Every response carries a Content-Security-Policy that allows scripts, styles
and images from this origin only (no inline script, no inline style), so even
a string that escaped escaping could not run.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import math
import re
import secrets
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily

from pipeline.console.data import ConsoleData
from pipeline.console.render import render_page, render_panels

if TYPE_CHECKING:
    from pipeline.ops_service import OpsService

STATIC_DIR = Path(__file__).parent / "static"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this host (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def presented_token(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <t>`` or the password of ``Authorization: Basic``."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")[2]
        except (
            binascii.Error,
            ValueError,
        ):  # ValueError: not base64 text at all (e.g. non-ASCII); covers UnicodeDecodeError
            return None
    return None


def _json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class _LiveFeedbackCollector:
    """``hourglass_live_feedback_rate{served_model,version}``: thumbs-up share of the last hour's
    rewarded traces per served version, read from the buffer when Prometheus scrapes (cached 30 s)."""

    def __init__(self) -> None:
        self.source: weakref.ReferenceType[ConsoleData] | None = None

    def collect(self):
        family = GaugeMetricFamily(
            "hourglass_live_feedback_rate",
            "Thumbs-up share (reward > 0) of the last hour's rewarded traces, per served model and adapter version.",
            labels=["served_model", "version"],
        )
        data = self.source() if self.source is not None else None
        if data is not None:
            for row in data.live_feedback():
                family.add_metric([row["model"], row["version"]], row["rate"])
        yield family

    def describe(self):  # registration must not read the buffer
        yield GaugeMetricFamily("hourglass_live_feedback_rate", "", labels=["served_model", "version"])


_COLLECTOR = _LiveFeedbackCollector()
REGISTRY.register(_COLLECTOR)


def mount_console(app: FastAPI, service: OpsService, *, refresh_s: int = 10) -> ConsoleData:
    """Add the status page routes (table in the module doc) to ``app``; returns its data source."""
    data = ConsoleData(service)
    _COLLECTOR.source = weakref.ref(data)
    open_view = is_loopback(service.cfg.api.host)
    app.state.console = data

    def require_view(request: Request) -> None:
        if open_view:
            return
        presented = presented_token(request)
        if presented is None or not secrets.compare_digest(presented.encode(), service.api_token.encode()):
            raise HTTPException(
                401,
                "the status page needs the API token on a non-loopback address",
                headers={"WWW-Authenticate": 'Basic realm="hourglass console"'},
            )

    def canary_abort_path() -> str | None:
        """The canary abort endpoint when the API has one (the button is hidden otherwise); a ``{model}``
        style path parameter is filled in by the page with the selected model."""
        for route in app.routes:
            path = getattr(route, "path", "")
            params = set(re.findall(r"\{(\w+)\}", path))
            if (
                "canary" in path
                and "abort" in path
                and "POST" in getattr(route, "methods", ())
                and params <= {"model", "served_model", "name"}
            ):
                return path
        return None

    @app.get("/", response_class=HTMLResponse, include_in_schema=False, dependencies=[Depends(require_view)])
    def console_page() -> HTMLResponse:
        return HTMLResponse(
            render_page(data.collect(), canary_abort=canary_abort_path(), refresh_s=refresh_s), headers=_HEADERS
        )

    @app.get(
        "/console/panels", response_class=HTMLResponse, include_in_schema=False, dependencies=[Depends(require_view)]
    )
    def console_panels() -> HTMLResponse:
        return HTMLResponse(render_panels(data.collect(), canary_abort=canary_abort_path()), headers=_HEADERS)

    @app.get("/console/data", dependencies=[Depends(require_view)])
    def console_data() -> Any:
        return JSONResponse(_json_safe(data.collect()), headers=_HEADERS)

    app.mount("/console/static", StaticFiles(directory=STATIC_DIR), name="console-static")
    return data
