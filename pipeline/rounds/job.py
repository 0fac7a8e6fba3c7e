"""One round, end to end, over the persisted state machine of :mod:`pipeline.rounds.records`.

    snapshot → train → evaluate → gate → register → promote → done | no_winner

Read :meth:`RoundRunner._run` top to bottom: it is the round. Each state is
recorded before its work starts, so a crash leaves a record that says where it
stopped, and :func:`recover` settles such records at the next start:

- before ``register`` nothing left the process: the round failed, and the
  adapters it had published into vLLM are unloaded;
- in ``register`` the result is write-ahead in the pending folder
  (:mod:`pipeline.registry.models`): recovery finishes the registration (no alias
  moves) and then runs the ``promote`` step;
- in ``promote`` the versions are registered: recovery runs the ``promote`` step
  again, which is idempotent (a version that already holds the alias keeps it),
  so every winner is promoted exactly once.

Registering moves no alias; the ``promote`` step does: ``@champion``, or with
``serving.canary.enabled`` ``@challenger``, compared live with the champion (or with the base model when
there is no champion yet).
The round's reward model (when it trains one) is registered in the ``register``
step too, as its own registered model (:mod:`pipeline.registry.reward_registry`).

The work of each state is a method of :class:`~pipeline.rounds.steps.RoundSteps`;
:class:`~pipeline.rounds.steps.LiveSteps` does it for real (buffer, trainer, MLflow, vLLM), tests
inject fakes. The ``gate`` state is a pure function of the trainer's evaluations
(:func:`trainer.evaluation.gate.gate_round`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime

from prometheus_client import Counter, Gauge, Histogram

from pipeline.config import HourglassConfig
from pipeline.errors import PipelineError
from pipeline.rounds.records import (
    RoundInProgressError,
    RoundLock,
    RoundRecord,
    RoundState,
    RoundStore,
)
from pipeline.rounds.until import check_until

from pipeline.rounds.steps import LiveSteps, RoundSteps, parse_window
from trainer.errors import NotEnoughDataError
from trainer.evaluation.gate import gate_round
from trainer.executors.executor import Executor
from trainer.executors.executor import make_executor
from trainer.types import PhaseBoundary, RoundPhase, RoundResult

log = logging.getLogger(__name__)

ROUND_SECONDS = Histogram(
    "hourglass_round_duration_seconds",
    "Wall time of a round, seconds.",
    buckets=(30, 60, 120, 300, 600, 1200, 3600, 7200),
)
ROUNDS = Counter("hourglass_rounds_total", "Rounds by outcome.", ["outcome"])
CANDIDATE_REWARD = Gauge(
    "hourglass_round_candidate_reward",
    "Held-out gate value (rl.gate.metric's: reward, reward-model score or feedback AUC) of each candidate in the last round.",
    ["candidate"],
)
CHAMPION_REWARD = Gauge(
    "hourglass_round_champion_reward",
    "Held-out gate value of the champion in the last round (same unit as the candidates').",
    ["served_model"],
)
REWARD_MODEL_AUC = Gauge(
    "hourglass_reward_model_auc", "Held-out AUC of the last round's reward model (NaN: undefined)."
)
PROMOTIONS = Counter("hourglass_promotions_total", "Versions promoted by rounds.", ["served_model"])


class RoundCancelled(Exception):
    """Raised between steps when a cancel was requested."""


class RoundNotCancellableError(PipelineError, RuntimeError):
    """The round has started ``register``: its result may already be in MLflow and the alias may move."""


# --- the round ------------------------------------------------------------------------


class RoundRunner:
    """Runs rounds one at a time and records them; shared by the scheduler, the API and the CLI."""

    def __init__(
        self,
        cfg: HourglassConfig,
        base_fingerprint: str,
        store: RoundStore | None = None,
        steps: RoundSteps | None = None,
    ) -> None:
        self.cfg = cfg
        self.base_fingerprint = base_fingerprint
        self.store = store or RoundStore(cfg.resolve(cfg.state_dir))
        self.steps: RoundSteps = steps or LiveSteps(cfg, base_fingerprint)
        self.executor: Executor = make_executor(cfg.rl)  # where candidates train: warmed at a round's start
        self.lock = RoundLock(cfg.resolve(cfg.state_dir))
        self._cancel = threading.Event()
        self._committed = False  # True from the register step on: the round can no longer be cancelled
        self._state_lock = threading.Lock()  # orders a cancel request against the register step
        self._abandoned: str | None = None  # set by settle_abandoned(): the round thread must not write its record
        self._thread: threading.Thread | None = None
        self.current: str | None = None
        self.on_promoted: list[
            Callable[[str, str], None]
        ] = []  # callbacks(model, version): e.g. wake the reconcile loop
        self.on_finished: list[Callable[[RoundRecord], None]] = []  # callbacks(final record): e.g. re-warm trainers

    def _run(self, record: RoundRecord) -> None:
        """The round, state by state."""
        self._step(record, RoundState.SNAPSHOT)
        self._start_trainers(record)
        if record.until is None:  # for schedule.min_new_traces; a replay trains on no new trace
            record.metrics["data/buffer_trace_rows"] = self.steps.buffer_rows()
        until = datetime.fromisoformat(record.until) if record.until else None
        table, data_metrics = self.steps.snapshot(record.window, until=until)
        record.metrics.update({k: v for k, v in data_metrics.items() if isinstance(v, (int, float))})
        if table.num_rows < 2:
            where = f"the {record.window} until {record.until}" if record.until else f"the last {record.window}"
            self.store.advance(
                record, RoundState.NO_WINNER, f"only {table.num_rows} row(s) in {where}; nothing to learn from"
            )
            return

        self._step(record, RoundState.TRAIN)  # evaluate is entered at the trainer's boundary (_at_boundary)
        result = self.steps.train_and_evaluate(record, table, lambda boundary: self._at_boundary(record, boundary))
        if (
            record.state is RoundState.TRAIN
        ):  # the trainer reported no evaluate boundary (e.g. a stand-in): it evaluated too
            self._step(record, RoundState.EVALUATE)

        self._step(record, RoundState.GATE)  # the gate: a pure function of the evaluations, one decision per model
        result = gate_round(result, self.cfg.rl)
        self._record_gate(record, result)

        self._step(record, RoundState.REGISTER)  # write-ahead: survives an MLflow outage or a crash from here on
        record.versions, register_metrics = self.steps.register(result)
        record.metrics.update(register_metrics)
        self.store.save(record)

        self._step(record, RoundState.PROMOTE)
        done = self.steps.promote(record)
        for model, version in record.versions.items():
            PROMOTIONS.labels(model).inc()
            for callback in self.on_promoted:
                callback(model, version)
        # a served model whose every candidate sat the round out has no decision: the skipped ones are named here
        sat_out = "".join(f"; {name} sat this round out: {why}" for name, why in record.skipped.items())
        if any(d["winner"] for d in record.decisions.values()):
            self.store.advance(record, RoundState.DONE, done + sat_out)
        else:
            reasons = "; ".join(f"{m}: {d['reason']}" for m, d in record.decisions.items())
            self.store.advance(record, RoundState.NO_WINNER, (reasons + sat_out).removeprefix("; "))

    def _start_trainers(self, record: RoundRecord) -> None:
        """The executor's workers (Ray: trainer actors) start now, unless kept ones fit, so their start-up overlaps
        the snapshot and the trainer's own preparation. A cluster that does not answer fails the round here, at
        its start (:class:`~trainer.errors.ExecutorUnavailableError`)."""
        self.executor.warm(self.cfg.model, len(record.candidates))

    # public API -----------------------------------------------------------------

    def start(
        self,
        trigger: str,
        candidates: list[str] | None = None,
        window: str | None = None,
        until: datetime | None = None,
    ) -> RoundRecord:
        """Start a round in a background thread and return its record.

        ``until``: train on the ``window`` that ended then (a replay of a past window, e.g. to learn what
        another recipe would have made of the same traffic) instead of the one ending now. The snapshot leaves
        out every trace and feedback event dated after ``until`` and judges implicit signals then; what was
        dated before it but ingested later is in it (a live round then had not seen it yet).

        Raises:
            RoundInProgressError: a round is running (here or in another process).
            ValueError: an unknown candidate name, a malformed window, or ``until`` without a time zone, in
                the future or so early that the window would start before year 1.
        """
        names = self._select(candidates)
        window = window or self.cfg.rl.window
        span = parse_window(window)
        if until is not None:
            check_until(until, span)
        round_id = self.store.new_round_id()
        self.lock.acquire(round_id)  # refused (RoundInProgressError) before any record is written
        try:
            record = self.store.create(trigger, names, window, round_id=round_id, until=until)
        except BaseException:
            self.lock.release()
            raise
        self._cancel.clear()
        self._committed, self._abandoned = False, None
        self.current = record.round_id
        self._thread = threading.Thread(
            target=self._run_locked, args=(record,), name=f"round-{record.round_id}", daemon=True
        )
        self._thread.start()
        return record

    def run(
        self,
        trigger: str,
        candidates: list[str] | None = None,
        window: str | None = None,
        until: datetime | None = None,
    ) -> RoundRecord:
        """Run a round in the calling thread; returns the final record."""
        record = self.start(trigger, candidates, window, until)
        self.wait()
        return self.store.get(record.round_id)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the running round; True when none is running any more."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def cancel(self) -> bool:
        """Ask the running round to stop at its next boundary: between training steps,
        between evaluation batches, or between states. False when no round runs.

        Raises:
            RoundNotCancellableError: the round has started ``register`` (its
                result is being written to MLflow and promoted); it runs to its end.
        """
        with self._state_lock:
            if self.current is None:
                return False
            if self._committed:
                raise RoundNotCancellableError(
                    f"round {self.current} has started register: it can no longer be cancelled (the alias may already "
                    "have moved); wait for it to finish, then roll back with `hourglass rollback` if needed"
                )
            self._cancel.set()
            return True

    def settle_abandoned(self, reason: str) -> str | None:
        """Mark the running round failed now (shutdown after the grace) and unload what it published.

        The round thread keeps running until the process exits but no longer
        writes its record. Returns the round id, or None when no round runs or
        it has started ``register`` (left for :func:`recover` at the next start).
        """
        with self._state_lock:
            round_id = self.current
            if round_id is None or self._committed or not self.running:
                return None
            self._abandoned = reason
        record = self.store.get(round_id)
        if not record.terminal:
            self.store.advance(record, RoundState.FAILED, f"{record.state}: {reason}")
        self.steps.unload(round_id, record.candidates)
        return round_id

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # internals -------------------------------------------------------------------

    def _select(self, candidates: list[str] | None) -> list[str]:
        known = [c.name for c in self.cfg.candidates]
        if not candidates:
            return known
        unknown = sorted(set(candidates) - set(known))
        if unknown:
            raise ValueError(f"unknown candidate(s) {unknown}; configured: {known}")
        return [n for n in known if n in candidates]

    def _step(self, record: RoundRecord, state: RoundState) -> None:
        """Enter ``state`` (persisted before its work starts); a pending cancel takes effect here, before ``register``."""
        with self._state_lock:
            if self._abandoned is not None:
                raise RoundCancelled(self._abandoned)
            if not self._committed and self._cancel.is_set():
                raise RoundCancelled(f"cancelled before {state}")
            if state.committed:
                self._committed = True  # from here on a cancel is refused
        self.store.advance(record, state)
        log.info("round %s: %s", record.round_id, state)

    def _at_boundary(self, record: RoundRecord, boundary: PhaseBoundary) -> None:
        """The trainer's hook: evaluation's start moves the record to ``evaluate``; at every other
        boundary (between training steps, between evaluation batches) a cancel takes effect."""
        if boundary.phase is RoundPhase.EVALUATE and boundary.starts_phase:
            self._step(record, RoundState.EVALUATE)
        elif self._abandoned is not None:
            raise RoundCancelled(self._abandoned)
        elif self._cancel.is_set():
            if boundary.phase is RoundPhase.EVALUATE:
                what = boundary.part if boundary.candidate is None else f"{boundary.part} of {boundary.candidate}"
                raise RoundCancelled(f"cancelled during evaluate (before {what})")
            raise RoundCancelled(f"cancelled during train (before {boundary.phase} step {boundary.step})")

    def _record_gate(self, record: RoundRecord, result: RoundResult) -> None:
        """``gate``: the decisions per served model (in the gate metric's unit, with each candidate's regression
        suite verdicts) go into the record and the gauges."""
        record.metrics.update(result.metrics)
        record.skipped = dict(result.skipped)
        for name in record.skipped:  # no value this round: not last round's
            try:
                CANDIDATE_REWARD.remove(name)
            except KeyError:
                pass
        record.decisions = {
            m: {
                "winner": d.winner,
                "reason": d.reason,
                "metric": d.metric,
                "champion_reward": d.champion_reward_mean,
                "candidate_rewards": d.candidate_reward_means,
                "lower_bounds": d.lower_bounds,
                "regression": {name: [asdict(v) for v in suites] for name, suites in d.regression.items()},
            }
            for m, d in result.decisions.items()
        }
        for model, decision in result.decisions.items():
            CHAMPION_REWARD.labels(model).set(decision.champion_reward_mean)
            for name, value in decision.candidate_reward_means.items():
                CANDIDATE_REWARD.labels(name).set(value)
        if result.reward_model is not None:
            REWARD_MODEL_AUC.set(result.reward_model.report.auc)
        self.store.save(record)

    def _run_locked(self, record: RoundRecord) -> None:
        started = time.monotonic()
        try:
            self._run(record)
        except RoundCancelled as err:
            if self._abandoned is None and not record.terminal:  # an abandoned round was settled by settle_abandoned()
                self.store.advance(record, RoundState.CANCELLED, str(err))
        except NotEnoughDataError as err:  # the window's data, not the service: no traceback, the champion serves on
            if self._abandoned is None and not record.terminal:
                if record.state in (RoundState.SNAPSHOT, RoundState.TRAIN):  # before any evaluation: nothing to judge
                    log.warning("round %s: no winner, not enough data: %s", record.round_id, err)
                    self.store.advance(record, RoundState.NO_WINNER, f"not enough data: {err}")
                else:  # the data was checked by then: an error, as any other in a later state
                    log.error("round %s failed in %s: not enough data: %s", record.round_id, record.state, err)
                    self.store.advance(record, RoundState.FAILED, f"{record.state}: not enough data: {err}")
        except Exception as err:  # a failed round leaves the champion serving
            log.exception("round %s failed", record.round_id)
            if self._abandoned is None and not record.terminal:
                self.store.advance(record, RoundState.FAILED, f"{record.state}: {type(err).__name__}: {err}")
        finally:
            if not self.executor.keeps_workers:  # workers started for a round that ended before training
                self.executor.release()  # (e.g. too few rows) do not outlive it
            ROUNDS.labels(record.state.value).inc()
            ROUND_SECONDS.observe(time.monotonic() - started)
            self.current = None
            self.lock.release()
            for callback in self.on_finished:
                try:
                    callback(record)
                except Exception:  # noqa: BLE001 - a callback must not break the runner
                    log.exception("round %s: an on_finished callback failed", record.round_id)


# --- recovery -------------------------------------------------------------------------


def recover(cfg: HourglassConfig, store: RoundStore, steps: RoundSteps | None = None) -> list[RoundRecord]:
    """Settle rounds a crash left unfinished; call once at service start (see the module docstring).

    Pending reward models are retried first. Nothing is settled while another
    process holds the round lock (that round is alive). A round whose registry
    work cannot finish now (MLflow down) stays in its state for the next start.
    Returns the records settled.
    """
    steps = steps or LiveSteps(cfg)
    steps.retry_pending_rewards()
    unfinished = store.unfinished()
    if not unfinished:
        return []
    lock = RoundLock(cfg.resolve(cfg.state_dir))
    try:
        lock.acquire("recovery")
    except RoundInProgressError as err:  # another live process runs that round: not ours to settle
        log.warning("rounds not settled now: %s", err)
        return []
    try:
        settled = [record for record in unfinished if _settle(cfg, store, record, steps)]
        steps.retry_pending()  # what the settled rounds left aside (e.g. rounds that failed at register earlier)
        return settled
    finally:
        lock.release()


def _settle(cfg: HourglassConfig, store: RoundStore, record: RoundRecord, steps: RoundSteps) -> bool:
    """Settle one unfinished round; False when it must wait for the registry."""
    died_in = record.state
    if not died_in.committed:
        store.advance(
            record, RoundState.FAILED, f"interrupted: the process died during {died_in}; nothing was registered"
        )
        if died_in is not RoundState.PENDING:
            names = sorted({*record.candidates, *(c.name for c in cfg.candidates)})
            unloaded = steps.unload(record.round_id, names)
            if unloaded:
                count = sum(len(v) for v in unloaded.values())
                store.transition(
                    record, RoundState.FAILED, f"{record.reason}; unloaded {count} adapter(s) it had left in vLLM"
                )
        return True
    try:
        record.versions = steps.registered_versions(
            record
        )  # died in register: the registration finishes, no alias moves
    except Exception as err:  # MLflow down: settle it at the next start
        log.warning(
            "round %s stays in %s: its registration cannot finish now (%s: %s)",
            record.round_id,
            died_in,
            type(err).__name__,
            err,
        )
        return False
    if not record.versions and any(d.get("winner") for d in record.decisions.values()):
        store.advance(
            record,
            RoundState.FAILED,
            f"interrupted: the process died during {died_in} before its result was written; nothing was registered",
        )
        return True
    if died_in is RoundState.REGISTER:
        store.advance(record, RoundState.PROMOTE)
    try:
        line = steps.promote(record) if record.versions else "nothing to promote"
    except Exception as err:  # MLflow went away again: the next start promotes
        store.save(record)
        log.warning("round %s stays in promote: %s: %s", record.round_id, type(err).__name__, err)
        return False
    outcome = RoundState.DONE if record.versions else RoundState.NO_WINNER
    store.advance(
        record,
        outcome,
        f"resumed after a restart (process died during {died_in}); registered {record.versions}; {line}",
    )
    return True
