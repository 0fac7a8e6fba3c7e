"""The reward model in MLflow: its own registered model and its own ``@champion``.

Each round that trained a reward model (see :mod:`trainer.reward_model.phase`)
registers it as a version of ``<serving.model_name>-reward`` (registered-model
and version tag ``hourglass.role = reward_model``), from a run of the round's
experiment (tag ``hourglass.run_kind = reward_model``, nested under the
round's run) holding its metrics and the folder ``reward_model`` (PEFT adapter
+ ``reward_head.safetensors``). The version carries the round's lineage tags,
``hourglass.sha256`` of its files (so staging verifies what it downloads) and
``hourglass.reward_auc``, its held-out AUC.

``@champion`` of the reward model moves to the new version (in the round's
``promote`` step, :func:`promote_reward_model`; registration records the decision) only when its
held-out AUC is finite and not below the current reward champion's AUC by
more than ``reward_model.auc_margin``. The champion's AUC is the one
re-measured on this round's held-out rows when the round had its files, else
the AUC recorded on its version.

Registration is write-ahead in the registry's outbox like the rounds'
(:mod:`pipeline.registry.outbox`, ``<state_dir>/registry/pending-reward/<round_id>/``) and idempotent
by round id; API from ``mlflow.tracking.MlflowClient``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

from pipeline.config import HourglassConfig
from pipeline.registry import aliases
from pipeline.registry.client import (
    TAG_CANDIDATE,
    TAG_KIND,
    TAG_ROUND,
    TAG_SHA256,
    RegistryError,
    RegistryUnavailableError,
    make_client,
    mlflow_reachable,
    adapter_checksums,
    ensure_experiment,
    find_round_version,
    find_runs,
    lineage_tags,
    short_retry,
    transient,
)
from pipeline.registry.outbox import REWARD_MODELS, Outbox
from pipeline.registry.signing import TAG_SIGNATURE, sign, signing_keys
from trainer.types import RewardModelReport, RewardModelResult, RoundResult

log = logging.getLogger(__name__)

TAG_ROLE = "hourglass.role"
ROLE = "reward_model"
TAG_AUC = "hourglass.reward_auc"
TAG_DECISION = "hourglass.reward_decision"
TAG_PROMOTE = "hourglass.reward_promote"  # "true" / "false": the decision, so a resumed registration finishes it
ARTIFACT = "reward_model"


@dataclass(frozen=True)
class RewardRegistration:
    """The version a round's reward model became, and whether ``@champion`` moved to it."""

    model: str
    version: str
    promoted: bool
    reason: str
    champion_before: str | None


def reward_model_name(cfg: HourglassConfig) -> str:
    """``<serving.model_name>-reward``."""
    return f"{cfg.serving.model_name}-reward"


def pending_reward_dir(cfg: HourglassConfig) -> Path:
    """The reward models' outbox folder (:data:`pipeline.registry.outbox.REWARD_MODELS`)."""
    return Outbox(cfg, REWARD_MODELS).root


def decide(new: RewardModelReport, champion_auc: float | None, margin: float) -> tuple[bool, str]:
    """Whether the new reward model becomes ``@champion``, and why (see the module docstring)."""
    if not math.isfinite(new.auc):
        return (
            False,
            f"held-out AUC undefined ({new.heldout_examples} held-out rows without both labels); champion kept",
        )
    if champion_auc is None or not math.isfinite(champion_auc):
        return True, f"held-out AUC {new.auc:.3f}; no comparable reward champion"
    if new.auc >= champion_auc - margin:
        return True, f"held-out AUC {new.auc:.3f} >= champion's {champion_auc:.3f} - margin {margin}"
    return False, f"held-out AUC {new.auc:.3f} < champion's {champion_auc:.3f} - margin {margin}; champion kept"


def save_pending(cfg: HourglassConfig, result: RoundResult) -> Path | None:
    """Write the round's reward model (files + result) to the pending folder, atomically; None without one."""
    rm = result.reward_model
    if rm is None:
        return None
    box = Outbox(cfg, REWARD_MODELS)
    files = box.entry(result.round_id) / "files"
    data = {"lineage": lineage_tags(result), "reward_model": asdict(rm) | {"adapter_dir": str(files)}}
    return box.put(result.round_id, data, {"files": rm.adapter_dir})


def _load_pending(data: dict) -> tuple[dict[str, str], RewardModelResult]:
    raw = data["reward_model"]
    champion = raw["champion_report"]
    rm = RewardModelResult(
        name=raw["name"],
        adapter_dir=Path(raw["adapter_dir"]),
        report=RewardModelReport(**raw["report"]),
        champion_report=RewardModelReport(**champion) if champion else None,
        step_metrics=tuple(raw["step_metrics"]),
        train_examples=raw["train_examples"],
        train_pairs=raw["train_pairs"],
    )
    return data["lineage"], rm


def _log_run(client: MlflowClient, cfg: HourglassConfig, lineage: dict[str, str], rm: RewardModelResult) -> str:
    experiment_id = ensure_experiment(client, cfg.registry.experiment)
    parents = find_runs(client, experiment_id, lineage[TAG_ROUND], "round")
    tags = {**lineage, TAG_KIND: ROLE, TAG_CANDIDATE: rm.name, TAG_ROLE: ROLE}
    if parents:
        tags["mlflow.parentRunId"] = parents[0].info.run_id
    run = client.create_run(experiment_id, tags=tags, run_name=f"{lineage[TAG_ROUND]}/{rm.name}")
    metrics = [Metric(k, float(v), 0, step) for step, row in enumerate(rm.step_metrics) for k, v in row.items()]
    metrics += [Metric(k, float(v), 0, 0) for k, v in rm.report.as_metrics().items()]
    for start in range(0, len(metrics), 900):
        client.log_batch(run.info.run_id, metrics=metrics[start : start + 900])
    client.log_artifacts(run.info.run_id, str(rm.adapter_dir), artifact_path=ARTIFACT)
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def _register_now(
    cfg: HourglassConfig, client: MlflowClient, lineage: dict[str, str], rm: RewardModelResult, promote: bool
) -> RewardRegistration:
    model, alias = reward_model_name(cfg), cfg.registry.champion_alias
    existing = find_round_version(client, model, lineage[TAG_ROUND])
    if existing is not None:  # a retry after a crash or a blip: registered and decided already
        version, current = str(existing.version), aliases.champion_version(client, model, alias)
        promoted = existing.tags.get(TAG_PROMOTE) == "true"
        if promote and promoted and current != version:  # the alias move did not happen yet
            aliases.promote(cfg, model, version, client=client, reason=f"round {lineage[TAG_ROUND]} (resumed)")
        return RewardRegistration(model, version, promoted, existing.tags.get(TAG_DECISION, ""), current)
    try:
        client.create_registered_model(
            model,
            tags={TAG_ROLE: ROLE},
            description=f"Reward model learned from the feedback on {cfg.serving.model_name!r} (Hourglass).",
        )
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    current = aliases.champion_version(client, model, alias)
    champion_auc = None
    if current is not None:
        if rm.champion_report is not None:
            champion_auc = rm.champion_report.auc
        else:
            recorded = client.get_model_version(model, current).tags.get(TAG_AUC)
            champion_auc = float(recorded) if recorded is not None else None
    promoted, reason = decide(rm.report, champion_auc, cfg.rl.reward_model.auc_margin)
    run_id = _log_run(client, cfg, lineage, rm)
    tags = {
        **lineage,
        TAG_ROLE: ROLE,
        TAG_CANDIDATE: rm.name,
        TAG_SHA256: json.dumps(adapter_checksums(rm.adapter_dir)),
        TAG_AUC: repr(rm.report.auc),
        TAG_DECISION: reason,
        TAG_PROMOTE: str(promoted).lower(),
    }
    tags[TAG_SIGNATURE] = sign(
        signing_keys(cfg)[0], model, tags
    )  # staging serves nothing unsigned, reward models included
    source = f"{client.get_run(run_id).info.artifact_uri}/{ARTIFACT}"
    version = str(client.create_model_version(model, source, run_id=run_id, tags=tags, description=reason).version)
    if promote and promoted:
        aliases.promote(cfg, model, version, client=client, reason=f"round {lineage[TAG_ROUND]}: {reason}")
    return RewardRegistration(model, version, promoted, reason, current)


def _register_entry(
    cfg: HourglassConfig, round_id: str, client: MlflowClient, promote: bool = True
) -> RewardRegistration:
    box = Outbox(cfg, REWARD_MODELS)
    folder = box.entry(round_id)
    lineage, rm = _load_pending(box.read(round_id) or {})
    try:
        registered = short_retry(_register_now)(cfg, client, lineage, rm, promote)
    except Exception as err:
        if transient(err) or not mlflow_reachable(cfg.registry.tracking_uri):
            raise RegistryUnavailableError(
                f"MLflow at {cfg.registry.tracking_uri} is unreachable ({type(err).__name__}); the reward model of round "
                f"{round_id!r} is kept in {folder} and will be registered by retry_pending_rewards()"
            ) from err
        raise RegistryError(
            f"MLflow refused to register the reward model of round {round_id!r}: {err}; kept in {folder}"
        ) from err
    box.done(round_id)
    return registered


def register_reward_model(
    cfg: HourglassConfig, result: RoundResult, client: MlflowClient | None = None, *, promote: bool = True
) -> RewardRegistration | None:
    """Register the round's reward model (write-ahead) and, with ``promote``, move its ``@champion`` when it earns it.

    A round registers with ``promote=False`` (its ``register`` step moves no alias): the decision is
    recorded on the version (``hourglass.reward_promote``) and :func:`promote_reward_model`, in the
    round's ``promote`` step, carries it out. Returns None when the round trained no reward model.

    Raises:
        RegistryUnavailableError: MLflow unreachable; the reward model stays pending.
        RegistryError: MLflow refused; the reward model stays pending.
    """
    folder = save_pending(cfg, result)
    if folder is None:
        return None
    return _register_entry(cfg, folder.name, client or make_client(cfg), promote)


def promote_reward_model(cfg: HourglassConfig, round_id: str, client: MlflowClient | None = None) -> bool:
    """Carry out the recorded decision for the reward model of ``round_id``: move ``@champion`` to its
    version when the decision says so and the alias is not there yet (idempotent). Returns whether it is champion.

    Raises:
        MlflowException, ConnectionError: MLflow refused or could not be reached.
    """
    client = client or make_client(cfg)
    model = reward_model_name(cfg)
    found = find_round_version(client, model, round_id)
    if found is None or found.tags.get(TAG_PROMOTE) != "true":
        return False
    version = str(found.version)
    if aliases.champion_version(client, model, cfg.registry.champion_alias) != version:
        aliases.promote(
            cfg, model, version, client=client, reason=f"round {round_id}: {found.tags.get(TAG_DECISION, '')}"
        )
    return True


def retry_pending_rewards(cfg: HourglassConfig, client: MlflowClient | None = None) -> list[RewardRegistration]:
    """Register every pending reward model, oldest first; stops at the first outage."""
    box = Outbox(cfg, REWARD_MODELS)
    out: list[RewardRegistration] = []
    for round_id in box.pending():
        try:
            out.append(_register_entry(cfg, round_id, client or make_client(cfg)))
        except RegistryUnavailableError:
            log.warning("MLflow still unreachable; reward models stay pending in %s", box.root)
            break
        except RegistryError as err:
            log.error("%s", err)
    return out
