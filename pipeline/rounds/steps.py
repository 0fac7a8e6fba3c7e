"""What each state of a round does: the contract :class:`RoundSteps`, and the real
work behind it (reward buffer, trainer, MLflow, vLLM) as plain functions.

The driver (:class:`pipeline.rounds.job.RoundRunner`) moves the state machine
and calls one :class:`RoundSteps` method per state;
:class:`pipeline.rounds.job.LiveSteps` binds the functions below to a config,
and tests pass fakes that run in milliseconds.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from pipeline.config import HourglassConfig
from pipeline.rounds.records import RoundRecord
from trainer.config import window_seconds
from trainer.types import PhaseHook, RoundResult

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

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

    def snapshot(self, window: str) -> tuple[pa.Table, dict[str, Any]]:
        """``snapshot``: the buffer's sealed rows of the last ``window`` and ``data/...`` metrics."""
        ...

    def train_and_evaluate(self, record: RoundRecord, table: pa.Table, on_phase: PhaseHook) -> RoundResult:
        """``train`` and ``evaluate`` (the trainer reports the boundary between them through ``on_phase``);
        the result carries the gate's decisions."""
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


# --- the real work -----------------------------------------------------------------------


def take_snapshot(cfg: HourglassConfig, window: str) -> tuple[pa.Table, dict[str, Any]]:
    """Sealed buffer rows of the last ``window`` (a consistent snapshot)."""
    from connectors.buffer import RewardBuffer

    end = datetime.now(timezone.utc)
    start = end - parse_window(window)
    table = RewardBuffer(cfg.buffer).snapshot(start, end)
    return table, {
        "data/rows": table.num_rows,
        "data/window_start": start.isoformat(),
        "data/window_end": end.isoformat(),
    }


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


def train_and_evaluate(
    cfg: HourglassConfig,
    record: RoundRecord,
    table: pa.Table,
    champions: dict[str, Path | None],
    checkpoint: PhaseHook | None = None,
    reward_champion: Path | None = None,
) -> RoundResult:
    """Split across users and time (per-user share capped), train the reward model (when wanted) and every
    selected candidate, evaluate against the champions, gate.

    ``checkpoint`` is passed to :func:`trainer.round.run_round` (typed phase boundaries; may raise to cancel);
    ``reward_champion`` is the staged folder of the reward model's ``@champion`` (see :func:`reward_champion_for`).
    """
    from trainer.round import run_round
    from trainer.data import split_snapshot, user_metrics

    train, heldout = split_snapshot(table, cfg.rl.heldout_fraction, max_user_share=cfg.rl.max_user_share)
    rl = cfg.rl  # rl.rollout_url defaults to the serving vLLM (filled by HourglassConfig)
    candidates = [c for c in cfg.candidates if c.name in record.candidates]
    out_dir = cfg.resolve(cfg.state_dir) / "rounds" / record.round_id
    result = run_round(
        cfg.model,
        candidates,
        rl,
        train,
        heldout,
        champions,
        out_dir,
        progress=False,
        round_id=record.round_id,
        checkpoint=checkpoint,
        reward_cfg=cfg.reward_model,
        reward_champion=reward_champion,
    )
    result.metrics.update(user_metrics(train, heldout))  # data/users, data/max_user_share: logged with the round's run
    return result


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


def reward_champion_for(cfg: HourglassConfig, names: list[str], base_fingerprint: str) -> Path | None:
    """The staged reward champion when this round trains a reward model (None otherwise, or when there is none)."""
    candidates = [c for c in cfg.candidates if c.name in names]
    if not cfg.reward_model.wanted(candidates, getattr(cfg.rl, "gate_metric", None)):
        return None
    return reward_champion(cfg, base_fingerprint)


def _buffer_trace_rows(cfg: HourglassConfig) -> int:
    from connectors.buffer import RewardBuffer

    return RewardBuffer(cfg.buffer).stats().trace_rows


def round_adapter_names(round_id: str, candidates: list[str]) -> re.Pattern[str]:
    """The names a round publishes into the rollout engine: ``<candidate>-s<step>``
    for its candidates and ``champion-<i>-<round_id>`` for the champions it evaluates."""
    cands = "|".join(re.escape(c) for c in sorted(set(candidates), key=len, reverse=True)) or "(?!)"
    return re.compile(rf"^(?:(?:{cands})-s[0-9]+|champion-[0-9]+-{re.escape(round_id)})$")


def unload_round_adapters(cfg: HourglassConfig, round_id: str, candidates: list[str]) -> dict[str, list[str]]:
    """Unload what a dead or abandoned round left loaded in vLLM, on every replica.

    Looks at ``serving.replicas``, ``rl.rollout_urls`` and ``rl.rollout_url``; a replica that does
    not answer is skipped (a restarted vLLM has lost its runtime adapters anyway).
    Only call it while no other round runs (it matches by candidate name).
    Returns ``{replica url: [unloaded names]}``.
    """
    from pipeline.serving.replica import Replica, ReplicaRefusedError, ReplicaUnreachableError

    pattern = round_adapter_names(round_id, candidates)
    urls = list(
        dict.fromkeys(
            [*cfg.serving.replicas, *cfg.rl.rollout_urls, *([cfg.rl.rollout_url] if cfg.rl.rollout_url else [])]
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


def _register_reward_model(cfg: HourglassConfig, result: RoundResult) -> dict[str, float]:
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


def _describe(outcomes: list[dict]) -> str:
    """One line for the record: what the promote step did with each winner."""
    return ", ".join(
        f"promoted {o['model']} v{o['version']}"
        if o["action"] == "promoted"
        else f"{o['model']} v{o['version']} not promoted: {o['reason']}"
        for o in outcomes
    )


def _challenge(cfg: HourglassConfig, record: RoundRecord) -> str:
    """Canary on: each winner becomes ``@challenger`` (or ``@champion`` when there is none); the record's line."""
    from pipeline.canary.state import describe, promote_or_challenge

    reason = f"round {record.round_id}"
    return describe([promote_or_challenge(cfg, m, v, reason=reason) for m, v in record.versions.items()])
