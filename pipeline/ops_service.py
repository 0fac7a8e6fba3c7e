"""What the ops API (:mod:`pipeline.api`), the status page (:mod:`pipeline.console`)
and the canary endpoints (:mod:`pipeline.canary.ops`) need of the running service.

:class:`pipeline.service.HourglassService` provides it. Those modules type
against :class:`OpsService`, never against the service module, so the wiring
runs one way: the service imports the API, the API never imports the service.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from connectors.ingest import IngestWorker
    from pipeline.canary.monitor import CanaryMonitor
    from pipeline.config import HourglassConfig
    from pipeline.rounds.job import RoundRunner
    from pipeline.rounds.records import RoundStore
    from pipeline.serving.controller import ServingController


class OpsService(Protocol):
    """The running service as the HTTP surfaces see it (attributes and calls of ``HourglassService``)."""

    cfg: HourglassConfig
    api_token: str  # the bearer token the ops API requires
    base_fingerprint: str  # the resident base's fingerprint (trainer.model.store.fingerprint_of)
    store: RoundStore
    runner: RoundRunner
    ingest_worker: IngestWorker | None  # None until started, or when ingestion is off
    controller: ServingController | None  # None when the reconcile loop is off
    canary: CanaryMonitor | None  # None when the canary is off

    def readiness(self) -> dict[str, bool]: ...
    def refresh_gauges(self) -> None: ...
    def buffer_stats(self) -> dict[str, Any]: ...
    def status(self) -> dict[str, Any]: ...
    def promote(self, model: str | None, version: str) -> dict[str, Any]: ...
    def rollback(self, model: str | None, to: str | None) -> dict[str, Any]: ...
