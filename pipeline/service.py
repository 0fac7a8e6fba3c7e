"""The always-on service: ingestion workers, the round scheduler, the
reconcile loop and the ops API in one process.

Start order (each needs the one before): config → base model → topics →
settle rounds a crash left (and unload what they left in vLLM) → ingest →
reconcile loop → canary monitor → scheduler → API. Ingest, reconcile, canary and
scheduler run as supervised workers (:mod:`pipeline.supervise`): one that raises is restarted
with backoff and shows in ``/readyz`` and ``/status`` meanwhile.
Shutdown order is written where it happens, in :meth:`HourglassService.shutdown`;
:func:`run_service` runs it on SIGTERM/SIGINT.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import Gauge

from pipeline.config import HourglassConfig, secret_problems
from pipeline.errors import ConfigError, PipelineError
from pipeline.redact import install_log_redaction
from pipeline.state_secrets import api_token
from pipeline.rounds.job import RoundNotCancellableError, RoundRunner, recover
from pipeline.rounds.records import RoundInProgressError, RoundLock, RoundStore, UnknownRoundError
from pipeline.supervise import Worker

if TYPE_CHECKING:
    from connectors.ingest import IngestWorker
    from pipeline.canary.monitor import CanaryMonitor
    from pipeline.serving.controller import ServingController

log = logging.getLogger(__name__)

WARM_THREAD = "trainer-warm"  # the background start of the executor's workers ahead of a round

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
        log.info(
            "scheduled round skipped: %d new trace(s) since the last round, need %d",
            since,
            service.cfg.schedule.min_new_traces,
        )
        return
    try:
        service.runner.start("schedule")
    except RoundInProgressError as err:
        log.info("scheduled round skipped: %s", err)


def scheduled_retry_pending() -> None:
    """The scheduler's job that retries registrations an MLflow outage left pending."""
    if _CURRENT is not None:
        _CURRENT.retry_pending_now()


class WorkerDiedError(PipelineError, RuntimeError):
    """A worker's inner thread stopped on its own (e.g. the APScheduler thread); it is restarted."""


class HourglassService:
    """Owns every long-running part; :meth:`start` / :meth:`shutdown`."""

    def __init__(
        self, cfg: HourglassConfig, *, base_fingerprint: str | None = None, ingest: bool = True, reconcile: bool = True
    ) -> None:
        from trainer.model import store as model_store

        install_log_redaction()  # before anything logs a URI with credentials
        problems = secret_problems(cfg)
        if problems:
            raise ConfigError(
                f"refusing to start a production service with unsafe secrets: {'; '.join(problems)}", problems
            )
        if cfg.rl.ray.keep_actors is None:  # always on: trainer actors (a Ray executor's) stay between rounds
            cfg = cfg.model_copy(
                update={"rl": cfg.rl.model_copy(update={"ray": cfg.rl.ray.model_copy(update={"keep_actors": True})})}
            )
        self.cfg = cfg
        if base_fingerprint is None:
            base_fingerprint = model_store.fingerprint_of(model_store.resolve(cfg.model.name, cfg.model.cache_dir))
        self.base_fingerprint = base_fingerprint
        self.api_token = api_token(cfg)
        self.store = RoundStore(cfg.resolve(cfg.state_dir))
        self.runner = RoundRunner(cfg, base_fingerprint, self.store)
        self.runner.on_finished.append(self._after_round)
        self._stopping = threading.Event()  # set by shutdown(): no more trainer warm-ups
        self._want_ingest, self._want_reconcile = ingest, reconcile
        self.ingest_worker: IngestWorker | None = None
        self.controller: ServingController | None = None
        self.canary: CanaryMonitor | None = None  # with the reconcile loop
        self.scheduler: BackgroundScheduler | None = None
        self.workers: dict[str, Worker] = {}

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

            self.ingest_worker = worker = IngestWorker(self.cfg.kafka, self.cfg.buffer)
            self._supervise("ingest", worker.run)
        if self._want_reconcile:
            from pipeline.serving.controller import ServingController

            models = sorted({c.served_model for c in self.cfg.candidates} | {self.cfg.serving.model_name})
            self.controller = controller = ServingController(
                self.cfg, models=models, base_fingerprint=self.base_fingerprint
            )
            self._supervise("reconcile", controller.run, on_stop=controller.trigger)
            self.runner.on_promoted.append(lambda _model, _version: controller.trigger())
            self._start_canary(models)
        _CURRENT = self
        self.warm_trainers()
        self.scheduler = self._make_scheduler()
        self.scheduler.start()
        self._supervise("scheduler", self._watch_scheduler)
        log.info("service started; next round: %s", self.next_round_at())

    def _after_round(self, _record: object) -> None:
        self.warm_trainers()

    def warm_trainers(self) -> threading.Thread | None:
        """An executor that keeps its workers between rounds (Ray with kept actors): start them in the background
        (at start, and after each round, which re-creates them after a failed one), so a round finds them loaded.
        A cluster that does not answer is logged here; the next round then fails at its start with the reason."""
        executor = self.runner.executor
        if not executor.keeps_workers or self._stopping.is_set():
            return None

        def warm() -> None:
            try:
                if executor.warm(self.cfg.model, len(self.cfg.candidates)):
                    log.info("trainer actors started (or still alive) for the next round")
            except Exception as err:  # noqa: BLE001 - logged; the next round reports it as its failure
                log.warning("could not start the trainer actors ahead of the next round: %s", err)

        thread = threading.Thread(target=warm, name=WARM_THREAD, daemon=True)
        thread.start()
        return thread

    def _supervise(self, name: str, target, on_stop=None) -> None:
        worker = Worker(name, target, on_stop=on_stop)
        self.workers[name] = worker
        worker.start()

    def _watch_scheduler(self, stop: threading.Event) -> None:
        """The scheduler worker: (re)start APScheduler, then raise if its thread stops on its own."""
        if self.scheduler is None or not self.scheduler.running:
            self.scheduler = self._make_scheduler()
            self.scheduler.start()
        while not stop.wait(1.0):
            thread = getattr(self.scheduler, "_thread", None)
            if not self.scheduler.running or (thread is not None and not thread.is_alive()):
                raise WorkerDiedError("the APScheduler thread stopped; starting a new scheduler")

    def _start_canary(self, models: list[str]) -> None:
        """The canary and guard loop (:mod:`pipeline.canary.monitor`); its decisions wake the reconcile loop."""
        if not (self.cfg.serving.canary.enabled or self.cfg.serving.guard.enabled):
            return
        from pipeline.canary.monitor import CanaryMonitor

        self.canary = canary = CanaryMonitor(self.cfg, models=models, on_change=self._wake_reconcile)
        self._supervise("canary", canary.run)  # restarted with backoff if a look raises; shown in /readyz and /status

    def _wake_reconcile(self, _model: str) -> None:
        if self.controller is not None:
            self.controller.trigger()

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
            trigger = (
                IntervalTrigger(seconds=sched.interval_s)
                if sched.interval_s
                else CronTrigger.from_crontab(sched.cron, timezone="UTC")
            )
            # replace_existing: the persisted job follows the config of this start.
            scheduler.add_job(scheduled_round, trigger, id="round", name="hourglass round", replace_existing=True)
        scheduler.add_job(
            scheduled_retry_pending,
            IntervalTrigger(seconds=sched.pending_retry_interval_s),
            id="retry-pending",
            name="hourglass pending registrations",
            replace_existing=True,
            next_run_time=datetime.now(timezone.utc),
        )  # first run at once: start-up too, not only when a round was left unfinished
        return scheduler

    def retry_pending_now(self) -> list:
        """Register what an MLflow outage left pending (skipped while a round runs).

        Updates the records of the rounds it registers and wakes the reconcile
        loop. Returns the :class:`~pipeline.registry.models.RegisteredVersion` list.
        """
        from pipeline.registry.models import RegistryError, list_pending, retry_pending

        if not list_pending(self.cfg):
            return []
        lock = RoundLock(self.cfg.resolve(self.cfg.state_dir))
        try:
            lock.acquire("pending-retry")
        except RoundInProgressError:
            log.info("pending registrations not retried now: a round is running")
            return []
        try:
            versions = retry_pending(self.cfg)
        except RegistryError as err:
            log.warning("pending registrations not retried: %s", err)
            return []
        finally:
            lock.release()
        for version in versions:
            self._note_late_registration(version)
        if versions and self.controller is not None:
            self.controller.trigger()
        return versions

    def _note_late_registration(self, version) -> None:
        try:
            record = self.store.get(version.round_id)
        except UnknownRoundError:
            return
        record.versions = {**record.versions, version.model: version.version}
        note = f"registered later from the pending folder: {version.model} v{version.version}"
        if record.terminal:  # e.g. failed at register: the state stays, the record says what happened since
            self.store.transition(record, record.state, f"{record.reason}; {note}" if record.reason else note)
        else:
            self.store.transition(record, "done", note)

    def shutdown(self, round_grace_s: float | None = None) -> None:
        """Stop everything, in this order:

        1. stop taking work: the scheduler fires no new round;
        2. finish or abort the round: ask it to cancel at its next boundary
           (refused from ``register`` on: it then runs to its end), wait
           ``round_grace_s`` (default ``schedule.shutdown_grace_s``); a round
           still running then is settled as failed and the adapters it
           published into vLLM are unloaded;
        3. stop ingestion: the worker finishes its batch, makes it durable in
           the buffer, commits the offsets, and closes the consumer;
        4. stop the canary monitor, then the reconcile loop (vLLM keeps serving the champion);
        5. the executor's kept workers: with ``rl.executor = "ray"``, kill the kept trainer actors and free their
           placement group.
        """
        global _CURRENT
        self._stopping.set()
        grace = self.cfg.schedule.shutdown_grace_s if round_grace_s is None else round_grace_s
        if "scheduler" in self.workers:  # 1
            self.workers["scheduler"].stop(10)
        if self.scheduler is not None and self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        if self.runner.running:  # 2
            try:
                self.runner.cancel()
            except RoundNotCancellableError as err:
                log.warning("shutdown: %s", err)
            if not self.runner.wait(grace):
                settled = self.runner.settle_abandoned(
                    f"still running {grace:g}s after the shutdown request; abandoned"
                )
                log.warning(
                    "round %s still running after %.0fs; %s",
                    self.runner.current,
                    grace,
                    "settled as failed" if settled else "left for recovery at the next start",
                )
        if "ingest" in self.workers:  # 3
            if not self.workers["ingest"].stop(30):
                log.warning("ingest did not stop within 30s; its uncommitted batch is redelivered at the next start")
        if "canary" in self.workers:  # 4: no alias moves once the reconcile loop is gone
            self.workers["canary"].stop(10)
        if "reconcile" in self.workers:  # 4
            self.workers["reconcile"].stop(10)
        for thread in threading.enumerate():  # 5: a warm-up still connecting or placing: let it finish first,
            if thread.name == WARM_THREAD:  # then the executor's kept workers (Ray: actors, placement group) go
                thread.join(self.cfg.rl.ray.connect_timeout_s)
        self.runner.executor.release()
        _CURRENT = None

    # -- what the API shows ------------------------------------------------------------

    def next_round_at(self) -> str | None:
        if self.scheduler is None:
            return None
        job = self.scheduler.get_job("round")
        return job.next_run_time.isoformat() if job is not None and job.next_run_time else None

    def readiness(self) -> dict[str, bool]:
        import httpx

        from pipeline.registry.models import mlflow_reachable

        checks = {name: worker.alive for name, worker in self.workers.items()}  # ingest, reconcile, canary, scheduler
        checks.setdefault("scheduler", bool(self.scheduler and self.scheduler.running))
        checks["mlflow"] = mlflow_reachable(self.cfg.registry.tracking_uri)
        health = getattr(self.ingest_worker, "health", None)
        if callable(health):
            checks["ingest storage"] = bool(self._safe(health).get("storage_ok", False))
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
            "canary": self.canary.status()
            if self.canary is not None
            else {},  # per model: the last look (pipeline.canary)
            "workers": {name: worker.state().as_dict() for name, worker in self.workers.items()},
        }

    @staticmethod
    def _safe(call) -> Any:
        try:
            return call()
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}

    # -- ops actions --------------------------------------------------------------------

    def promote(self, model: str | None, version: str) -> dict[str, Any]:
        from pipeline.registry.aliases import promote

        out = promote(self.cfg, model or self.cfg.serving.model_name, version, reason="ops api")
        if self.controller is not None:
            self.controller.trigger()
        return out

    def rollback(self, model: str | None, to: str | None) -> dict[str, Any]:
        from pipeline.registry.aliases import rollback

        out = rollback(self.cfg, model or self.cfg.serving.model_name, to)
        if self.controller is not None:
            self.controller.trigger()
        return out


def _api_server(app, cfg: HourglassConfig):
    """A uvicorn server with its signal handling taken out: :func:`run_service` owns SIGTERM/SIGINT.

    (uvicorn restores the previous handlers on exit and re-raises the signal it
    caught, which would kill the process before the service's shutdown runs.)
    """
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn >= 0.29
            yield

        def install_signal_handlers(self) -> None:  # older uvicorn
            pass

    return Server(api_server_config(app, cfg))


def api_server_config(app, cfg: HourglassConfig):
    """The ops API's uvicorn config: ``api.host:api.port`` behind the request-head limits of ``api``
    (:mod:`connectors.edge`: header bytes, count and timeout, checked before the token)."""
    from connectors.edge import EdgeLimits, server_config

    limits = EdgeLimits(cfg.api.max_header_bytes, cfg.api.max_headers, cfg.api.header_timeout_s)
    return server_config(app, cfg.api.host, cfg.api.port, limits, log_level="warning")


SHUTDOWN_MARKER = "hourglass service: shutdown complete"


def run_service(cfg: HourglassConfig) -> None:
    """Start the service and serve the API until SIGINT/SIGTERM, then shut down in order.

    Returns normally after a clean stop (exit code 0) and logs
    :data:`SHUTDOWN_MARKER`. A second SIGINT/SIGTERM during the shutdown is
    ignored (systemd's ``TimeoutStopSec`` SIGKILL is the hard stop).
    """
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the reconcile loop polls every few seconds

    from pipeline.api import create_api

    received: list[int] = []
    server = None

    def on_signal(signum: int, _frame) -> None:
        if received:
            log.warning("%s again: shutdown already in progress", signal.Signals(signum).name)
            return
        received.append(signum)
        log.warning("%s received: shutting down", signal.Signals(signum).name)
        if server is not None:
            server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    service = HourglassService(cfg)
    started = time.monotonic()
    try:
        service.start()
        token_path = Path(cfg.resolve(cfg.state_dir)) / "api-token"
        log.info(
            "ops API on http://%s:%d (token: %s)",
            cfg.api.host,
            cfg.api.port,
            "api.token" if cfg.api.token else token_path,
        )
        server = _api_server(create_api(service), cfg)
        if not received:  # a signal during start-up: go straight to the shutdown
            server.run()
    finally:
        stop_started = time.monotonic()
        service.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        why = signal.Signals(received[0]).name if received else "server exit"
        log.info(
            "%s (%s; shutdown took %.1fs, up %.0fs)",
            SHUTDOWN_MARKER,
            why,
            time.monotonic() - stop_started,
            stop_started - started,
        )
