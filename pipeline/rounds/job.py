"""One round, end to end, as named steps over the persisted state machine.

    snapshot → train (+ evaluate, inside the trainer) → gate → register → promote

The round's reward model (when it trains one) is registered in the
``register`` step too, as its own registered model (see :mod:`pipeline.registry.reward_registry`).

Each step records its state in :class:`~pipeline.rounds.records.RoundStore` before it
starts, so a crash leaves a record that says where it stopped
(:func:`recover` settles such records at the next start). Registration is
write-ahead and idempotent by round id (see :mod:`pipeline.registry.models`), so a
resumed round is registered and promoted at most once.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
from prometheus_client import Counter, Gauge, Histogram

from pipeline.config import HourglassConfig
from pipeline.errors import PipelineError
from pipeline.rounds.records import RoundInProgressError, RoundLock, RoundRecord, RoundStore
from trainer.config import window_seconds

log = logging.getLogger(__name__)

ROUND_SECONDS = Histogram("hourglass_round_duration_seconds", "Wall time of a round, seconds.", buckets=(30, 60, 120, 300, 600, 1200, 3600, 7200))
ROUNDS = Counter("hourglass_rounds_total", "Rounds by outcome.", ["outcome"])
CANDIDATE_REWARD = Gauge("hourglass_round_candidate_reward", "Held-out gate value (rl.gate_metric's: reward, reward-model score or feedback AUC) of each candidate in the last round.", ["candidate"])
CHAMPION_REWARD = Gauge("hourglass_round_champion_reward", "Held-out gate value of the champion in the last round (same unit as the candidates').", ["served_model"])
REWARD_MODEL_AUC = Gauge("hourglass_reward_model_auc", "Held-out AUC of the last round's reward model (NaN: undefined).")
PROMOTIONS = Counter("hourglass_promotions_total", "Versions promoted by rounds.", ["served_model"])


class RoundCancelled(Exception):
    """Raised between steps when a cancel was requested."""


class RoundNotCancellableError(PipelineError, RuntimeError):
    """The round has started ``register``: its result may already be in MLflow and the alias may move."""


def parse_window(window: str) -> timedelta:
    """``"6h"`` → 6 hours. Units: s, m, h, d; 1 s to ten years.

    Raises:
        ValueError: not a number followed by one unit, or out of range.
    """
    return timedelta(seconds=window_seconds(window))


# --- the steps -------------------------------------------------------------------------


def take_snapshot(cfg: HourglassConfig, window: str) -> tuple[pa.Table, dict[str, Any]]:
    """Sealed buffer rows of the last ``window`` (a consistent snapshot)."""
    from connectors.buffer import RewardBuffer

    end = datetime.now(timezone.utc)
    start = end - parse_window(window)
    table = RewardBuffer(cfg.buffer).snapshot(start, end)
    return table, {"data/rows": table.num_rows, "data/window_start": start.isoformat(), "data/window_end": end.isoformat()}


def champion_adapters(cfg: HourglassConfig, served_models: set[str], base_fingerprint: str) -> dict[str, Path | None]:
    """Served model → the staged folder of its current ``@champion`` (None: the base serves)."""
    from pipeline.registry.aliases import champion_version
    from pipeline.registry.models import make_client
    from pipeline.serving.staging import stage_options, stage_version

    client = make_client(cfg)
    out: dict[str, Path | None] = {}
    for model in sorted(served_models):
        version = None
        try:
            version = champion_version(client, model, cfg.registry.champion_alias)
        except Exception as err:  # no registered model yet is the common case
            log.info("no champion for %s yet (%s)", model, err)
        if version is None:
            out[model] = None
            continue
        staged = stage_version(
            client, model, version, cfg.resolve(cfg.serving.staging_dir), base_fingerprint=base_fingerprint, **stage_options(cfg),
        )  # fmt: skip
        out[model] = staged.path
    return out


def train_and_evaluate(
    cfg: HourglassConfig, record: RoundRecord, table: pa.Table, champions: dict[str, Path | None], checkpoint: Callable[[str], None] | None = None,
    reward_champion: Path | None = None,
):
    """Split across users and time (per-user share capped), train the reward model (when wanted) and every
    selected candidate, evaluate against the champions, gate.

    ``checkpoint`` is passed to :func:`trainer.candidates.run_round` (phase boundaries; may raise to cancel);
    ``reward_champion`` is the staged folder of the reward model's ``@champion`` (see :func:`reward_champion_for`).
    """
    from trainer.candidates import run_round
    from trainer.tasks import split_snapshot, user_metrics

    train, heldout = split_snapshot(table, cfg.rl.heldout_fraction, max_user_share=cfg.rl.max_user_share)
    rl = cfg.rl  # rl.rollout_url defaults to the serving vLLM (filled by HourglassConfig)
    candidates = [c for c in cfg.candidates if c.name in record.candidates]
    out_dir = cfg.resolve(cfg.state_dir) / "rounds" / record.round_id
    result = run_round(
        cfg.model, candidates, rl, train, heldout, champions, out_dir, progress=False, round_id=record.round_id, checkpoint=checkpoint,
        reward_cfg=cfg.reward_model, reward_champion=reward_champion,
    )  # fmt: skip
    result.metrics.update(user_metrics(train, heldout))  # data/users, data/max_user_share: logged with the round's run
    return result


def reward_champion_for(cfg: HourglassConfig, names: list[str], base_fingerprint: str) -> Path | None:
    """The staged reward champion when this round trains a reward model (None otherwise, or when there is none)."""
    candidates = [c for c in cfg.candidates if c.name in names]
    if not cfg.reward_model.wanted(candidates, getattr(cfg.rl, "gate_metric", None)):
        return None
    from pipeline.registry.reward_registry import reward_champion

    return reward_champion(cfg, base_fingerprint)


def _buffer_trace_rows(cfg: HourglassConfig) -> int:
    from connectors.buffer import RewardBuffer

    return RewardBuffer(cfg.buffer).stats().trace_rows


# --- the round ------------------------------------------------------------------------


class RoundRunner:
    """Runs rounds one at a time and records them; shared by the scheduler, the API and the CLI."""

    def __init__(self, cfg: HourglassConfig, base_fingerprint: str, store: RoundStore | None = None) -> None:
        self.cfg = cfg
        self.base_fingerprint = base_fingerprint
        self.store = store or RoundStore(cfg.resolve(cfg.state_dir))
        self.lock = RoundLock(cfg.resolve(cfg.state_dir))
        self._cancel = threading.Event()
        self._committed = False  # True from the register step on: the round can no longer be cancelled
        self._state_lock = threading.Lock()  # orders a cancel request against the register step
        self._abandoned: str | None = None  # set by settle_abandoned(): the round thread must not write its record
        self._thread: threading.Thread | None = None
        self.current: str | None = None
        self.on_promoted: list = []  # callbacks(model, version): e.g. wake the reconcile loop

    # public API -----------------------------------------------------------------

    def start(self, trigger: str, candidates: list[str] | None = None, window: str | None = None) -> RoundRecord:
        """Start a round in a background thread and return its record.

        Raises:
            RoundInProgressError: a round is running (here or in another process).
            ValueError: an unknown candidate name or a malformed window.
        """
        names = self._select(candidates)
        window = window or self.cfg.rl.window
        parse_window(window)
        round_id = self.store.new_round_id()
        self.lock.acquire(round_id)  # refused (RoundInProgressError) before any record is written
        try:
            record = self.store.create(trigger, names, window, round_id=round_id)
        except BaseException:
            self.lock.release()
            raise
        self._cancel.clear()
        self._committed, self._abandoned = False, None
        self.current = record.round_id
        self._thread = threading.Thread(target=self._run_locked, args=(record,), name=f"round-{record.round_id}", daemon=True)
        self._thread.start()
        return record

    def run(self, trigger: str, candidates: list[str] | None = None, window: str | None = None) -> RoundRecord:
        """Run a round in the calling thread; returns the final record."""
        record = self.start(trigger, candidates, window)
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
        between evaluation batches, or between phases. False when no round runs.

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
        self.store.transition(record, "failed", f"{record.state}: {reason}")
        unload_round_adapters(self.cfg, round_id, record.candidates)
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

    def _step(self, record: RoundRecord, state: str) -> None:
        with self._state_lock:
            if self._abandoned is not None:
                raise RoundCancelled(self._abandoned)
            if not self._committed and self._cancel.is_set():
                raise RoundCancelled(f"cancelled before {state}")
            if state == "register":
                self._committed = True  # from here on a cancel is refused
        self.store.transition(record, state)
        log.info("round %s: %s", record.round_id, state)

    def _checkpoint(self, record: RoundRecord, phase: str) -> None:
        """Called by the trainer between training steps, before evaluation and between
        evaluation batches (``"evaluate:<what>"``): a cancel takes effect here."""
        if phase == "evaluate":
            self._step(record, "evaluate")
        elif self._abandoned is not None:
            raise RoundCancelled(self._abandoned)
        elif self._cancel.is_set():
            if phase.startswith("evaluate:"):  # "evaluate:greedy", "evaluate:score:<candidate>"
                raise RoundCancelled(f"cancelled during evaluate (before {phase.removeprefix('evaluate:').replace(':', ' of ')})")
            raise RoundCancelled(f"cancelled during train (before {phase.replace(':', ' step ')})")  # "train:3", "reward_model:3"

    def _run_locked(self, record: RoundRecord) -> None:
        started = time.monotonic()
        try:
            self._run(record)
        except RoundCancelled as err:
            if self._abandoned is None:  # an abandoned round was settled by settle_abandoned()
                self.store.transition(record, "cancelled", str(err))
        except Exception as err:  # a failed round leaves the champion serving
            log.exception("round %s failed", record.round_id)
            if self._abandoned is None:
                self.store.transition(record, "failed", f"{record.state}: {type(err).__name__}: {err}")
        finally:
            ROUNDS.labels(record.state).inc()
            ROUND_SECONDS.observe(time.monotonic() - started)
            self.current = None
            self.lock.release()

    def _run(self, record: RoundRecord) -> None:
        from pipeline.registry.models import register_round
        from pipeline.registry.reward_registry import save_pending as save_reward_pending

        self._step(record, "snapshot")
        record.metrics["data/buffer_trace_rows"] = _buffer_trace_rows(self.cfg)  # for schedule.min_new_traces
        table, data_metrics = take_snapshot(self.cfg, record.window)
        record.metrics.update({k: v for k, v in data_metrics.items() if isinstance(v, (int, float))})
        if table.num_rows < 2:
            self.store.transition(record, "no_winner", f"only {table.num_rows} row(s) in the last {record.window}; nothing to learn from")
            return

        self._step(record, "train")
        served = {c.served_model for c in self.cfg.candidates if c.name in record.candidates}
        champions = champion_adapters(self.cfg, served, self.base_fingerprint)
        reward_champion = reward_champion_for(self.cfg, record.candidates, self.base_fingerprint)
        result = train_and_evaluate(
            self.cfg, record, table, champions, checkpoint=lambda phase: self._checkpoint(record, phase), reward_champion=reward_champion
        )  # fmt: skip

        record.metrics.update(result.metrics)
        record.decisions = {
            m: {"winner": d.winner, "reason": d.reason, "metric": d.metric, "champion_reward": d.champion_reward_mean,
                "candidate_rewards": d.candidate_reward_means, "lower_bounds": d.lower_bounds}
            for m, d in result.decisions.items()
        }  # fmt: skip
        for model, decision in result.decisions.items():  # both in the unit of the gate metric (decision.metric)
            CHAMPION_REWARD.labels(model).set(decision.champion_reward_mean)
            for name, value in decision.candidate_reward_means.items():
                CANDIDATE_REWARD.labels(name).set(value)
        if result.reward_model is not None:
            REWARD_MODEL_AUC.set(result.reward_model.report.auc)
        self.store.save(record)

        self._step(record, "register")  # write-ahead: survives an MLflow outage or a crash from here on
        save_reward_pending(self.cfg, result)  # write-ahead too: recover() registers it after a crash from here on
        canary = self.cfg.serving.canary.enabled  # the winner goes to @challenger first (pipeline.canary)
        started = time.perf_counter()
        versions = register_round(self.cfg, result, promote=not canary)
        record.metrics["time/register_s"] = time.perf_counter() - started
        record.versions = {v.model: v.version for v in versions}
        record.metrics.update(_register_reward_model(self.cfg, result))

        self._step(record, "promote")
        done = "promoted " + ", ".join(f"{m} v{v}" for m, v in record.versions.items())
        if canary:
            done = _challenge(self.cfg, record)
        for model, version in record.versions.items():
            PROMOTIONS.labels(model).inc()
            for callback in self.on_promoted:
                callback(model, version)
        winners = {m: d["winner"] for m, d in record.decisions.items() if d["winner"]}
        if winners:
            self.store.transition(record, "done", done)
        else:
            reasons = "; ".join(f"{m}: {d['reason']}" for m, d in record.decisions.items())
            self.store.transition(record, "no_winner", reasons)


def round_adapter_names(round_id: str, candidates: list[str]) -> re.Pattern[str]:
    """The names a round publishes into the rollout engine: ``<candidate>-s<step>``
    for its candidates and ``champion-<i>-<round_id>`` for the champions it evaluates."""
    cands = "|".join(re.escape(c) for c in sorted(set(candidates), key=len, reverse=True)) or "(?!)"
    return re.compile(rf"^(?:(?:{cands})-s[0-9]+|champion-[0-9]+-{re.escape(round_id)})$")


def unload_round_adapters(cfg: HourglassConfig, round_id: str, candidates: list[str]) -> dict[str, list[str]]:
    """Unload what a dead or abandoned round left loaded in vLLM, on every replica.

    Looks at ``serving.replicas`` and ``rl.rollout_url``; a replica that does
    not answer is skipped (a restarted vLLM has lost its runtime adapters anyway).
    Only call it while no other round runs (it matches by candidate name).
    Returns ``{replica url: [unloaded names]}``.
    """
    from pipeline.serving.replica import Replica, ReplicaRefusedError, ReplicaUnreachableError

    pattern = round_adapter_names(round_id, candidates)
    urls = list(dict.fromkeys([*cfg.serving.replicas, *([cfg.rl.rollout_url] if cfg.rl.rollout_url else [])]))
    api_key = cfg.serving.api_key.get_secret_value() if cfg.serving.api_key is not None else None
    unloaded: dict[str, list[str]] = {}
    for url in urls:
        replica = Replica(url, timeout_s=30, api_key=api_key)
        try:
            for name in [n for n in replica.models() if pattern.match(n)]:
                replica.unload(name)
                unloaded.setdefault(url, []).append(name)
        except (ReplicaUnreachableError, ReplicaRefusedError) as err:
            log.warning("round %s: could not unload its adapters from %s: %s", round_id, url, err)
        finally:
            replica.close()
    if unloaded:
        log.warning("round %s: unloaded adapters it left in vLLM: %s", round_id, unloaded)
    return unloaded


def _register_reward_model(cfg: HourglassConfig, result) -> dict[str, float]:
    """Register the round's reward model; an MLflow failure leaves it pending (retried by :func:`recover`)
    and does not fail the round. Returns ``reward_model/version`` and ``reward_model/promoted`` when registered."""
    from pipeline.registry.models import RegistryError
    from pipeline.registry.reward_registry import register_reward_model

    try:
        registered = register_reward_model(cfg, result)
    except RegistryError as err:
        log.warning("round %s: reward model not registered yet: %s", result.round_id, err)
        return {}
    if registered is None:
        return {}
    log.info("round %s: reward model %s v%s (%s)", result.round_id, registered.model, registered.version, registered.reason)
    return {"reward_model/version": float(registered.version), "reward_model/promoted": float(registered.promoted)}


def _challenge(cfg: HourglassConfig, record: RoundRecord) -> str:
    """Canary on: each winner becomes ``@challenger`` (or ``@champion`` when there is none); the record's line."""
    from pipeline.canary.state import describe, promote_or_challenge

    reason = f"round {record.round_id}"
    return describe([promote_or_challenge(cfg, m, v, reason=reason) for m, v in record.versions.items()])


def recover(cfg: HourglassConfig, store: RoundStore) -> list[RoundRecord]:
    """Settle rounds a crash left unfinished; call once at service start.

    Before ``register`` nothing left the process: the round is marked failed.
    From ``register`` on the result is write-ahead in the pending folder:
    :func:`pipeline.registry.models.retry_pending` registers and promotes it once
    (idempotent by round id), and the round is marked done. A round settled
    as failed also loses the adapters it had published into vLLM
    (:func:`unload_round_adapters`). Nothing is settled while another process
    holds the round lock (that round is alive).
    """
    from pipeline.registry.models import RegistryError
    from pipeline.registry.reward_registry import retry_pending_rewards

    settled: list[RoundRecord] = []
    try:
        retry_pending_rewards(cfg)
    except RegistryError as err:
        log.warning("pending reward models not retried yet: %s", err)
    unfinished = store.unfinished()
    if not unfinished:
        return settled
    lock = RoundLock(cfg.resolve(cfg.state_dir))
    try:
        lock.acquire("recovery")
    except RoundInProgressError as err:  # another live process runs that round: not ours to settle
        log.warning("rounds not settled now: %s", err)
        return settled
    try:
        return _settle(cfg, store, unfinished)
    finally:
        lock.release()


def _settle(cfg: HourglassConfig, store: RoundStore, unfinished: list[RoundRecord]) -> list[RoundRecord]:
    from pipeline.registry.models import RegistryError, find_round_version, list_pending, make_client, retry_pending

    settled: list[RoundRecord] = []
    registered = {}
    try:
        registered = {v.model: v.version for v in retry_pending(cfg)}
    except RegistryError as err:
        log.warning("pending registrations not retried yet: %s", err)
    for record in unfinished:
        if record.state in ("register", "promote"):
            if record.round_id in list_pending(cfg):
                log.warning("round %s stays in %s: its registration is pending (MLflow unreachable)", record.round_id, record.state)
                continue
            client = make_client(cfg)
            versions = {}
            try:
                for model in record.decisions or {}:
                    mv = find_round_version(client, model, record.round_id)
                    if mv is not None:
                        versions[model] = str(mv.version)
            except Exception as err:  # MLflow down: settle it at the next start
                log.warning("round %s not settled yet: %s", record.round_id, err)
                continue
            record.versions = versions or {m: v for m, v in registered.items()}
            note = ""
            if cfg.serving.canary.enabled and record.versions:
                try:
                    note = f"; {_challenge(cfg, record)}"
                except Exception as err:  # MLflow went away again: the operator can start it with `hourglass canary`
                    note = f"; canary not started ({type(err).__name__}: {err})"
            store.transition(record, "done", f"resumed after a restart (process died during {record.state}); registered {record.versions}{note}")
        else:
            store.transition(record, "failed", f"interrupted: the process died during {record.state}; nothing was registered")
            if record.state != "pending":
                names = sorted({*record.candidates, *(c.name for c in cfg.candidates)})
                unloaded = unload_round_adapters(cfg, record.round_id, names)
                if unloaded:
                    count = sum(len(v) for v in unloaded.values())
                    store.transition(record, "failed", f"{record.reason}; unloaded {count} adapter(s) it had left in vLLM")
        settled.append(record)
    return settled
