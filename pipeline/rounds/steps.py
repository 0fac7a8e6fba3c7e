"""What each state of a round does: the contract :class:`RoundSteps`, and beside it the real work
(:class:`LiveSteps`: the reward buffer, the trainer, MLflow and vLLM).

The driver (:class:`pipeline.rounds.job.RoundRunner`) moves the state machine and calls one
:class:`RoundSteps` method per state (the ``gate`` state calls the trainer's pure gate on what
``train_and_evaluate`` returned); tests pass fakes that run in milliseconds.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from pipeline.config import HourglassConfig
from pipeline.errors import PipelineError
from pipeline.rounds.records import RoundRecord
from trainer.config import CandidateConfig, window_seconds
from trainer.types import PhaseHook, RoundResult

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from trainer.model.base import KeptBase
    from trainer.round import RoundParts

log = logging.getLogger(__name__)


def parse_window(window: str) -> timedelta:
    """``"6h"`` → 6 hours. Units: s, m, h, d; 1 s to ten years.

    Raises:
        ValueError: not a number followed by one unit, or out of range.
    """
    return timedelta(seconds=window_seconds(window))


class RoundSteps(Protocol):
    """The work behind each state of a round (and of its recovery); :class:`LiveSteps` is the real one."""

    def buffer_rows(self) -> int:
        """Trace rows in the whole buffer now (recorded for ``schedule.min_new_traces``)."""
        ...

    def snapshot(self, window: str, until: datetime | None = None) -> tuple[pa.Table, dict[str, Any]]:
        """``snapshot``: the buffer's sealed rows of the last ``window`` (ending ``until``, else now) and
        ``data/...`` metrics."""
        ...

    def train_and_evaluate(self, record: RoundRecord, table: pa.Table, on_phase: PhaseHook) -> RoundResult:
        """``train`` and ``evaluate`` (the trainer reports the boundary between them through ``on_phase``);
        the result carries one evaluation per served model, for the ``gate`` state."""
        ...

    def register(self, result: RoundResult) -> tuple[dict[str, str], dict[str, float]]:
        """``register``: write the round and its winners to the registry, moving no alias.
        Returns served model -> registered version, and ``time/...`` / ``reward_model/...`` metrics."""
        ...

    def promote(self, record: RoundRecord) -> str:
        """``promote``: move each of ``record.versions``' alias; idempotent. Returns one line for the record."""
        ...

    def registered_versions(self, record: RoundRecord) -> dict[str, str]:
        """Recovery of a round that died in ``register`` or ``promote``: finish its registration
        (moving no alias) or find its versions. Raises when the registry cannot answer (retried later)."""
        ...

    def retry_pending_rewards(self) -> None:
        """Recovery: register the reward models earlier outages left pending."""
        ...

    def retry_pending(self) -> None:
        """Recovery: register (and promote, when owed) the results of rounds that gave up at ``register``."""
        ...

    def unload(self, round_id: str, candidates: list[str]) -> dict[str, list[str]]:
        """Unload the adapters a dead or abandoned round published into vLLM: replica URL -> names."""
        ...


Trainer = Callable[..., RoundResult]
"""How :class:`LiveSteps` runs the trainer's round: :func:`trainer.round.run_round` (a test passes a fake)."""


class LiveSteps:
    """The real work of each state: the reward buffer, the trainer, MLflow and vLLM.

    ``base_fingerprint`` is needed to train (it checks what the champions were
    trained on); recovery alone may leave it out. ``trainer``: the trainer's round
    (default :func:`trainer.round.run_round`, imported when a round first trains).
    """

    def __init__(
        self, cfg: HourglassConfig, base_fingerprint: str | None = None, *, trainer: Trainer | None = None
    ) -> None:
        self.cfg = cfg
        self.base_fingerprint = base_fingerprint
        self.trainer = trainer
        self.kept_base: KeptBase | None = None  # the resident base between rounds (rl.keep_base), made by the first

    def buffer_rows(self) -> int:
        from connectors.buffer import RewardBuffer

        return RewardBuffer(self.cfg.buffer).stats().trace_rows

    def snapshot(self, window: str, until: datetime | None = None) -> tuple[pa.Table, dict[str, Any]]:
        """Sealed buffer rows of the last ``window`` (a consistent snapshot); with ``until``, of the window that
        ended then, as a round at that time could have taken it: no trace, feedback or implicit evidence dated
        after ``until``, and the signals judged then."""
        from connectors.buffer import RewardBuffer

        end = until or datetime.now(timezone.utc)
        start = end - parse_window(window)
        table = RewardBuffer(self.cfg.buffer).snapshot(start, end, as_of=until)
        return table, {
            "data/rows": table.num_rows,
            "data/window_start": start.isoformat(),
            "data/window_end": end.isoformat(),
        }

    def train_and_evaluate(self, record: RoundRecord, table: pa.Table, on_phase: PhaseHook) -> RoundResult:
        """Split across users and time (per-key and per-user shares capped) and prepare the round's data; stage the
        champions (and the reward model's, when the round trains one); train the reward model (when
        wanted) and every selected candidate; evaluate them against the champions."""
        from trainer.data import prepare_round_data, split_snapshot
        from trainer.types import RoundInputs, RoundSpec

        if self.base_fingerprint is None:
            raise PipelineError(
                "a round needs the base model's fingerprint to train; construct LiveSteps with base_fingerprint"
            )
        cfg = self.cfg
        candidates = tuple(c for c in cfg.candidates if c.name in record.candidates)
        split = cfg.rl.split
        shares = {"max_user_share": split.max_user_share, "max_key_share": split.max_key_share}
        train, heldout = split_snapshot(table, split.heldout_fraction, **shares)
        champions, reward_champion = self.champions(candidates)
        inputs = RoundInputs(prepare_round_data(train, heldout, **shares), champions, reward_champion)
        spec = RoundSpec(cfg.model, candidates, cfg.rl)  # rl.rollout.url defaults to the serving vLLM
        run = self.trainer or _run_round()
        out_dir = cfg.resolve(cfg.state_dir) / "rounds" / record.round_id
        return run(spec, inputs, out_dir, round_id=record.round_id, on_phase=on_phase, parts=self._parts())

    def _parts(self) -> RoundParts:
        """What the round reuses from this process: the kept base (``rl.keep_base``), else nothing."""
        from trainer.model.base import KeptBase
        from trainer.round import RoundParts

        if not self.cfg.rl.keep_base:
            self.kept_base = None
            return RoundParts()
        if self.kept_base is None:
            self.kept_base = KeptBase()
        return RoundParts(kept_base=self.kept_base)

    def champions(self, candidates: Sequence[CandidateConfig]) -> tuple[dict[str, Path | None], Path | None]:
        """What the round competes against, staged and verified: per served model its ``@champion``'s folder
        (None: the base serves), and the reward model's ``@champion`` when this round trains a reward model."""
        assert self.base_fingerprint is not None
        champions = champion_adapters(self.cfg, {c.served_model for c in candidates}, self.base_fingerprint)
        if not self.cfg.rl.reward_model.wanted(list(candidates), self.cfg.rl.gate.metric):
            return champions, None
        return champions, reward_champion(self.cfg, self.base_fingerprint)

    def register(self, result: RoundResult) -> tuple[dict[str, str], dict[str, float]]:
        from pipeline.registry import models as registry
        from pipeline.registry import reward_registry

        reward_registry.save_pending(
            self.cfg, result
        )  # write-ahead too: recover() registers it after a crash from here on
        started = time.perf_counter()
        # Without the canary, a round that gives up here still owes @champion its winner: retry_pending() promotes it later.
        versions = registry.register_winners(self.cfg, result, promotion_owed=not self.cfg.serving.canary.enabled)
        metrics = {"time/register_s": time.perf_counter() - started}
        metrics.update(register_round_reward_model(self.cfg, result))
        return {v.model: v.version for v in versions}, metrics

    def promote(self, record: RoundRecord) -> str:
        from pipeline.registry import models as registry
        from pipeline.registry import reward_registry

        if any(
            k.startswith("reward_model/") for k in record.metrics
        ):  # the round trained one: carry out its recorded decision
            reward_registry.promote_reward_model(self.cfg, record.round_id)
        if self.cfg.serving.canary.enabled:  # the winner goes to @challenger first (pipeline.canary)
            return challenge(self.cfg, record)
        return describe_promotions(registry.promote_winners(self.cfg, record.round_id, record.versions))

    def registered_versions(self, record: RoundRecord) -> dict[str, str]:
        from pipeline.registry import models as registry
        from pipeline.registry.client import find_round_version, make_client

        finished = registry.register_pending(self.cfg, record.round_id)
        if finished is not None:
            return {v.model: v.version for v in finished}
        client = make_client(self.cfg)
        versions = {}
        for model in record.decisions or {}:
            mv = find_round_version(client, model, record.round_id)
            if mv is not None:
                versions[model] = str(mv.version)
        return versions

    def retry_pending_rewards(self) -> None:
        from pipeline.registry import client as registry_client
        from pipeline.registry import reward_registry

        try:
            reward_registry.retry_pending_rewards(self.cfg)
        except registry_client.RegistryError as err:
            log.warning("pending reward models not retried yet: %s", err)

    def retry_pending(self) -> None:
        from pipeline.registry import client as registry_client
        from pipeline.registry import models as registry

        try:
            registry.retry_pending(self.cfg)
        except registry_client.RegistryError as err:
            log.warning("pending registrations not retried yet: %s", err)

    def unload(self, round_id: str, candidates: list[str]) -> dict[str, list[str]]:
        return unload_round_adapters(self.cfg, round_id, candidates)


# --- the pieces of the live steps -----------------------------------------------------------------


def _run_round() -> Trainer:
    from trainer.round import run_round  # imported when a round first trains (torch, transformers)

    return run_round


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
            client,
            model,
            version,
            cfg.staging_root(),
            base_fingerprint=base_fingerprint,
            **stage_options(cfg),
        )
        out[model] = staged.path
    return out


REWARD_MODEL_MAX_RANK = 256  # staging's rank check is for vLLM; the reward model is never served by vLLM


def reward_champion(cfg: HourglassConfig, base_fingerprint: str, client: MlflowClient | None = None) -> Path | None:
    """The staged, verified folder of the reward model's ``@champion`` (None: no champion, or MLflow down)."""
    from pipeline.registry.aliases import champion_version
    from pipeline.registry.client import make_client
    from pipeline.registry.reward_registry import reward_model_name
    from pipeline.serving.staging import stage_options, stage_version

    try:
        client = client or make_client(cfg)
        version = champion_version(client, reward_model_name(cfg), cfg.registry.champion_alias)
        if version is None:
            return None
        options = {
            **stage_options(cfg),
            "max_lora_rank": REWARD_MODEL_MAX_RANK,
        }  # signature, size cap, adapter config: as for policies
        staged = stage_version(
            client,
            reward_model_name(cfg),
            version,
            cfg.staging_root(),
            base_fingerprint=base_fingerprint,
            **options,
        )
        return staged.path
    except Exception as err:  # the round still trains; without the champion's files its recorded AUC is used
        log.warning("reward champion not staged (%s: %s); its recorded AUC will be used", type(err).__name__, err)
        return None


def register_round_reward_model(cfg: HourglassConfig, result: RoundResult) -> dict[str, float]:
    """Register the round's reward model; an MLflow failure leaves it pending (retried by :func:`recover`)
    and does not fail the round. Returns ``reward_model/version`` and ``reward_model/promoted`` when registered."""
    from pipeline.registry.client import RegistryError
    from pipeline.registry.reward_registry import register_reward_model

    try:
        registered = register_reward_model(cfg, result, promote=False)  # the promote step moves its alias
    except RegistryError as err:
        log.warning("round %s: reward model not registered yet: %s", result.round_id, err)
        return {}
    if registered is None:
        return {}
    log.info(
        "round %s: reward model %s v%s (%s)", result.round_id, registered.model, registered.version, registered.reason
    )
    return {"reward_model/version": float(registered.version), "reward_model/promoted": float(registered.promoted)}


def describe_promotions(outcomes: list[dict]) -> str:
    """One line for the record: what the promote step did with each winner."""
    return ", ".join(
        f"promoted {o['model']} v{o['version']}"
        if o["action"] == "promoted"
        else f"{o['model']} v{o['version']} not promoted: {o['reason']}"
        for o in outcomes
    )


def challenge(cfg: HourglassConfig, record: RoundRecord) -> str:
    """Canary on: each winner becomes ``@challenger`` (or ``@champion`` when there is none); the record's line."""
    from pipeline.canary.state import describe, promote_or_challenge

    reason = f"round {record.round_id}"
    return describe([promote_or_challenge(cfg, m, v, reason=reason) for m, v in record.versions.items()])


def round_adapter_names(round_id: str, candidates: list[str]) -> re.Pattern[str]:
    """The names a round publishes into the rollout engine: ``<candidate>-s<step>``
    for its candidates and ``champion-<i>-<round_id>`` for the champions it evaluates."""
    cands = "|".join(re.escape(c) for c in sorted(set(candidates), key=len, reverse=True)) or "(?!)"
    return re.compile(rf"^(?:(?:{cands})-s[0-9]+|champion-[0-9]+-{re.escape(round_id)})$")


def unload_round_adapters(cfg: HourglassConfig, round_id: str, candidates: list[str]) -> dict[str, list[str]]:
    """Unload what a dead or abandoned round left loaded in vLLM, on every replica.

    Looks at ``serving.replicas``, ``rl.rollout.urls`` and ``rl.rollout.url``; a replica that does
    not answer is skipped (a restarted vLLM has lost its runtime adapters anyway).
    Only call it while no other round runs (it matches by candidate name).
    Returns ``{replica url: [unloaded names]}``.
    """
    from pipeline.serving.replica import Replica, ReplicaRefusedError, ReplicaUnreachableError

    pattern = round_adapter_names(round_id, candidates)
    urls = list(
        dict.fromkeys(
            [*cfg.serving.replicas, *cfg.rl.rollout.urls, *([cfg.rl.rollout.url] if cfg.rl.rollout.url else [])]
        )
    )
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
