"""What the serving controller and its canary step (:mod:`pipeline.serving.challenger`)
share; a leaf module, so the step does not import the controller that calls it."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone


class AdapterFailure(Exception):
    """The adapter (not the network) made a hot-load fail: staging refused it, or a replica refused
    its load or probe. The version is tagged and not served; the current champion keeps serving."""


def utc_now() -> str:
    """Now, UTC, ISO 8601 to the second (e.g. ``2026-01-31T12:00:00+00:00``): route and status timestamps."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class ModelStatus:
    """What the controller knows about one served model (JSON-ready)."""

    model: str
    desired: str | None = None
    serving: str | None = None
    last_error: str | None = None
    last_error_version: str | None = None
    last_hotload_s: float | None = None
    replicas: dict[str, object] = field(default_factory=dict)  # url -> served names, or "unreachable: ..."
    challenger: dict | None = None  # the canary: {"version", "served_name", "fraction"} once routed
    updated_at: str | None = None
    transient_errors: int = 0  # replica problems met for this model since start (retried, never refused)
    last_transient_error: str | None = None
