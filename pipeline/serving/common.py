"""What the serving controller and its canary step (:mod:`pipeline.canary.serving_hook`)
share; a leaf module, so the step does not import the controller that calls it."""

from __future__ import annotations

from datetime import datetime, timezone


class AdapterFailure(Exception):
    """The adapter (not the network) made a hot-load fail: staging refused it, or a replica refused
    its load or probe. The version is tagged and not served; the current champion keeps serving."""


def utc_now() -> str:
    """Now, UTC, ISO 8601 to the second (e.g. ``2026-01-31T12:00:00+00:00``): route and status timestamps."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
