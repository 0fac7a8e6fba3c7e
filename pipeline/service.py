"""The always-on service: ingestion workers, the round scheduler, the
reconcile loop and the ops API in one process.

Start order (each needs the one before): config → base model → topics →
settle rounds a crash left → ingest → reconcile loop → scheduler → API.
Shutdown order is written where it happens, in :meth:`HourglassService.shutdown`.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import Gauge

from pipeline.config import HourglassConfig, secret_problems
from pipeline.errors import ConfigError
from pipeline.redact import install_log_redaction
from pipeline.round_job import RoundRunner, recover
from pipeline.rounds import RoundInProgressError, RoundStore

log = logging.getLogger(__name__)

INGESTED = Gauge("hourglass_ingest_records", "Trace and feedback records made durable in the buffer since start.")
INGEST_DEAD = Gauge("hourglass_ingest_dead_letters", "Records dead-lettered since start.")
INGEST_LAG = Gauge("hourglass_ingest_consumer_lag", "Consumer lag in records, summed over partitions.")
BUFFER_ROWS = Gauge("hourglass_buffer_rows", "Trace rows in the reward buffer.")

_CURRENT: "HourglassService | None" = None  # the scheduler's persistent job calls into this


def scheduled_round() -> None:
    """The scheduler's job (a plain module-level function so the SQLite job store can persist it)."""
    if _CURRENT is None:
        log.warning("scheduled round fired with no running service; skipped")
        return
    service = _CURRENT
    rows = service.buffer_stats().get("trace_rows", 0)
    last = [r for r in service.store.list(limit=20) if "data/buffer_trace_rows" in r.metrics]
    since = rows - int(last[0].metrics["data/buffer_trace_rows"]) if last else rows
    if since < service.cfg.schedule.min_new_traces:
        log.info("scheduled round skipped: %d new trace(s) since the last round, need %d", since, service.cfg.schedule.min_new_traces)
        return
    try:
        service.runner.start("schedule")
    except RoundInProgressError as err:
        log.info("scheduled round skipped: %s", err)


def api_token(cfg: HourglassConfig) -> str:
    """``api.token`` when set; else the token in ``<state_dir>/api-token`` (created 0600 on first use)."""
    if cfg.api.token is not None:
        return cfg.api.token.get_secret_value()
    path = cfg.resolve(cfg.state_dir) / "api-token"
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    return token


class HourglassService:
    """Owns every long-running part; :meth:`start` / :meth:`shutdown`."""

    def __init__(self, cfg: HourglassConfig, *, base_fingerprint: str | None = None, ingest: bool = True, reconcile: bool = True) -> None:
        from trainer import model_store

        install_log_redaction()  # before anything logs a URI with credentials
        problems = secret_problems(cfg)
        if problems:
            raise ConfigError(f"refusing to start a production service with unsafe secrets: {'; '.join(problems)}", problems)
        self.cfg = cfg
        if base_fingerprint is None:
            base_fingerprint = model_store.fingerprint_of(model_store.resolve(cfg.model.name, cfg.model.cache_dir))
        self.base_fingerprint = base_fingerprint
        self.api_token = api_token(cfg)
        self.store = RoundStore(cfg.resolve(cfg.state_dir))
        self.runner = RoundRunner(cfg, base_fingerprint, self.store)
        self._want_ingest, self._want_reconcile = ingest, reconcile
        self.ingest_worker = None
        self._ingest_stop = threading.Event()
        self._ingest_thread: threading.Thread | None = None
        self.controller = None
        self.canary = None  # pipeline.canary.monitor.CanaryMonitor, with the reconcile loop
        self.scheduler: BackgroundScheduler | None = None

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        global _CURRENT
        from connectors.kafka_admin import ensure_topics

        if self._want_ingest:
            ensure_topics(self.cfg.kafka)
        settled = recover(self.cfg, self.store)  # before any new round can start
        for record in settled:
            log.warning("round %s settled after restart: %s (%s)", record.round_id, record.state, record.reason)
        if self._want_ingest:
            from connectors.ingest import IngestWorker

            self.ingest_worker = IngestWorker(self.cfg.kafka, self.cfg.buffer)
            self._ingest_thread = threading.Thread(target=self.ingest_worker.run, args=(self._ingest_stop,), name="ingest", daemon=True)
            self._ingest_thread.start()
        if self._want_reconcile:
            from pipeline.serving import ServingController

            models = sorted({c.served_model for c in self.cfg.candidates} | {self.cfg.serving.model_name})
            self.controller = ServingController(self.cfg, models=models, base_fingerprint=self.base_fingerprint)
            self.controller.start()
            self.runner.on_promoted.append(lambda _model, _version: self.controller.trigger())
            self._start_canary(models)
        _CURRENT = self
        self.scheduler = self._make_scheduler()
        self.scheduler.start()
        log.info("service started; next round: %s", self.next_round_at())

    def _start_canary(self, models: list[str]) -> None:
        """The canary and guard loop (:mod:`pipeline.canary.monitor`); its decisions wake the reconcile loop."""
        if not (self.cfg.serving.canary.enabled or self.cfg.serving.guard.enabled):
            return
        from pipeline.canary.monitor import CanaryMonitor

        self.canary = CanaryMonitor(self.cfg, models=models, on_change=lambda _m: self.controller.trigger())
        self.canary.start()

    def _make_scheduler(self) -> BackgroundScheduler:
        sched = self.cfg.schedule
        jobstore = SQLAlchemyJobStore(url=f"sqlite:///{self.cfg.resolve(self.cfg.state_dir) / 'jobs.sqlite'}")
        scheduler = BackgroundScheduler(
            jobstores={"default": jobstore},
            executors={"default": ThreadPoolExecutor(1)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": sched.misfire_grace_s},
            timezone="UTC",
        )
        if sched.enabled:
            trigger = IntervalTrigger(seconds=sched.interval_s) if sched.interval_s else CronTrigger.from_crontab(sched.cron, timezone="UTC")
            # replace_existing: the persisted job follows the config of this start.
            scheduler.add_job(scheduled_round, trigger, id="round", name="hourglass round", replace_existing=True)
        return scheduler

    def shutdown(self, round_grace_s: float = 30.0) -> None:
        """Stop everything, in this order:

        1. stop taking work: the scheduler fires no new round;
        2. finish or abort the round: ask it to cancel at its next step, wait
           ``round_grace_s``; a round still training is abandoned (its record
           is settled as failed at the next start);
        3. stop ingestion: the worker finishes its batch, makes it durable in
           the buffer, commits the offsets, and closes the consumer;
        4. stop the reconcile loop (vLLM keeps serving the champion).
        """
        global _CURRENT
        if self.scheduler is not None and self.scheduler.running:  # 1
            self.scheduler.shutdown(wait=False)
        if self.runner.running:  # 2
            self.runner.cancel()
            if not self.runner.wait(round_grace_s):
                log.warning("round %s still running after %.0fs; abandoning it", self.runner.current, round_grace_s)
        self._ingest_stop.set()  # 3
        if self._ingest_thread is not None:
            self._ingest_thread.join(60)
        if self.canary is not None:  # 4: no alias moves once the reconcile loop is gone
            self.canary.stop()
        if self.controller is not None:  # 4
            self.controller.stop()
        _CURRENT = None

    # -- what the API shows ------------------------------------------------------------

    def next_round_at(self) -> str | None:
        if self.scheduler is None:
            return None
        job = self.scheduler.get_job("round")
        return job.next_run_time.isoformat() if job is not None and job.next_run_time else None

    def readiness(self) -> dict[str, bool]:
        import httpx

        from pipeline.registry import mlflow_reachable

        checks = {
            "scheduler": bool(self.scheduler and self.scheduler.running),
            "mlflow": mlflow_reachable(self.cfg.registry.tracking_uri),
        }
        if self._want_ingest:
            checks["ingest"] = bool(self._ingest_thread and self._ingest_thread.is_alive())
        for url in self.cfg.serving.replicas:
            try:
                checks[f"vllm {url}"] = httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                checks[f"vllm {url}"] = False
        return checks

    def refresh_gauges(self) -> None:
        if self.ingest_worker is not None:
            stats = self.ingest_worker.stats()
            metrics = stats.as_metrics()
            INGESTED.set(metrics.get("ingest/traces", 0) + metrics.get("ingest/feedback", 0))
            INGEST_DEAD.set(metrics.get("ingest/dead_letters", 0))
            INGEST_LAG.set(metrics.get("ingest/lag_records", 0))
        try:
            BUFFER_ROWS.set(self.buffer_stats().get("trace_rows", 0))
        except Exception:  # an unreadable buffer shows in /status, not here
            pass

    def buffer_stats(self) -> dict[str, Any]:
        from connectors.buffer import RewardBuffer

        return RewardBuffer(self.cfg.buffer).stats().as_dict()

    def status(self) -> dict[str, Any]:
        rounds = [r.as_dict() for r in self.store.list(limit=5)]
        return {
            "round_running": self.runner.current,
            "next_round_at": self.next_round_at(),
            "recent_rounds": rounds,
            "serving": self.controller.status() if self.controller is not None else {},
            "ingest": self.ingest_worker.stats().as_metrics() if self.ingest_worker is not None else {},
            "buffer": self._safe(self.buffer_stats),
            "canary": self.canary.status() if self.canary is not None else {},  # per model: the last look (pipeline.canary)
        }

    @staticmethod
    def _safe(call) -> Any:
        try:
            return call()
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}

    # -- ops actions --------------------------------------------------------------------

    def promote(self, model: str | None, version: str) -> dict[str, Any]:
        from pipeline.aliases import promote

        out = promote(self.cfg, model or self.cfg.serving.model_name, version, reason="ops api")
        if self.controller is not None:
            self.controller.trigger()
        return out

    def rollback(self, model: str | None, to: str | None) -> dict[str, Any]:
        from pipeline.aliases import rollback

        out = rollback(self.cfg, model or self.cfg.serving.model_name, to)
        if self.controller is not None:
            self.controller.trigger()
        return out


def run_service(cfg: HourglassConfig) -> None:
    """Start the service and serve the API until SIGINT/SIGTERM, then shut down in order."""
    import uvicorn

    logging.getLogger("httpx").setLevel(logging.WARNING)  # the reconcile loop polls every few seconds

    from pipeline.api import create_api

    service = HourglassService(cfg)
    service.start()
    token_path = Path(cfg.resolve(cfg.state_dir)) / "api-token"
    log.info("ops API on http://%s:%d (token: %s)", cfg.api.host, cfg.api.port, "api.token" if cfg.api.token else token_path)
    server = uvicorn.Server(uvicorn.Config(create_api(service), host=cfg.api.host, port=cfg.api.port, log_level="warning"))
    try:
        server.run()  # returns after SIGTERM/SIGINT (uvicorn installs the handlers)
    finally:
        service.shutdown()
        log.info("service stopped")
