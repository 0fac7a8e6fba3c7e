"""The MLflow side of a round: runs, the winner's model version, and pending
registrations that wait on local disk while MLflow is unreachable.

Layout in MLflow (source: the MLflow tracking and model-registry APIs,
``mlflow.tracking.MlflowClient``):

- experiment ``registry.experiment``; one parent run per round, tagged
  ``hourglass.round_id``, ``hourglass.window_start`` / ``window_end`` (ISO 8601,
  UTC), ``hourglass.trace_count`` and ``hourglass.base_fingerprint``;
- one nested run per candidate (``mlflow.parentRunId``): the recipe as params,
  per-step metrics (``train/loss`` ... with the optimizer step as MLflow step),
  evaluation metrics, and the adapter folder as the artifact ``adapter``;
- one registered model per served model name; the gate's winner becomes a
  model version carrying the same lineage tags plus ``hourglass.sha256`` (JSON
  ``{file name: sha256 hex}`` of the adapter files) so staging can verify
  what it downloads, and ``hourglass.signature``: the service's HMAC over the
  model name, round id, candidate, base fingerprint and checksums
  (:mod:`pipeline.registry.signing`); staging serves nothing whose signature fails.

Params and descriptions written here are redacted (:mod:`pipeline.redact`):
no credential in a URI reaches MLflow.

Registration is write-ahead: the round (and a copy of its adapters) is saved
under ``<state_dir>/registry/pending/<round_id>/`` first and removed only once
MLflow holds everything, so nothing is lost when MLflow is down;
:func:`retry_pending` finishes the job on a later cycle. Every step is
idempotent by the round id tag, so a retry never registers a version twice.

Registering moves no alias. Promotion is its own step (:func:`promote_winners`,
the round's ``promote`` state); the alias moves themselves (promote, rollback)
live in :mod:`pipeline.registry.aliases`. The MLflow client factory, the registry
errors and the tag names live in the leaf :mod:`pipeline.registry.client`,
which both modules import.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pipeline.config import HourglassConfig
from pipeline.redact import redact
from pipeline.registry import aliases
from pipeline.registry.client import (
    TAG_CANDIDATE,
    TAG_KIND,
    TAG_ROUND,
    TAG_SHA256,
    TAG_WINDOW_END,
    RegistryError,
    RegistryUnavailableError,
    adapter_checksums,
    ensure_experiment,
    find_round_version,
    find_runs,
    lineage_tags,
    make_client,
    mlflow_reachable,
)
from pipeline.registry.client import short_retry as _short_retry
from pipeline.registry.client import transient as _transient
from pipeline.registry.outbox import ROUNDS, Outbox
from pipeline.registry.signing import TAG_SIGNATURE, sign, signing_keys
from trainer.types import CandidateResult, GateDecision, RoundResult, SuiteVerdict

log = logging.getLogger(__name__)

ADAPTER_ARTIFACT = "adapter"


@dataclass(frozen=True)
class RegisteredVersion:
    """A model version created (or found) for a round's winner."""

    model: str
    version: str
    round_id: str
    candidate: str
    run_id: str


# --- pending registrations on local disk (the outbox) -----------------------------------------


def _result_to_json(result: RoundResult, adapters_root: Path, promote: bool) -> dict:
    data = asdict(result)
    del data["evaluations"]  # what the gate read; its decisions are kept, and registering needs no more
    data["window_start"] = result.window_start.isoformat()
    data["window_end"] = result.window_end.isoformat()
    for cand in data["candidates"]:
        cand["adapter_dir"] = str(adapters_root / cand["name"])
    data["_promote"] = promote
    return data


def _result_from_json(data: dict) -> tuple[RoundResult, bool]:
    candidates = tuple(
        CandidateResult(
            **{
                **c,
                "adapter_dir": Path(c["adapter_dir"]),
                "step_metrics": tuple(c["step_metrics"]),
                "eval_rewards": tuple(c["eval_rewards"]),
            }
        )
        for c in data["candidates"]
    )
    result = RoundResult(
        round_id=data["round_id"],
        base_fingerprint=data["base_fingerprint"],
        window_start=datetime.fromisoformat(data["window_start"]),
        window_end=datetime.fromisoformat(data["window_end"]),
        train_rows=data["train_rows"],
        heldout_rows=data["heldout_rows"],
        eval_prompt_ids=tuple(data["eval_prompt_ids"]),
        candidates=candidates,
        decisions={k: _decision_from_json(v) for k, v in data["decisions"].items()},
        metrics=data.get("metrics", {}),
        skipped={str(k): str(v) for k, v in skipped.items()}
        if isinstance(skipped := data.get("skipped"), dict)
        else {},
    )
    return result, bool(data.get("_promote", False))


def _decision_from_json(data: dict) -> GateDecision:
    """A gate decision as :func:`_result_to_json` wrote it (entries written before regression suites have none)."""
    regression = {
        name: tuple(SuiteVerdict(**v) for v in verdicts) for name, verdicts in (data.get("regression") or {}).items()
    }
    return GateDecision(**{**data, "regression": regression})


def save_pending(cfg: HourglassConfig, result: RoundResult, promote: bool) -> Path:
    """Write the round and a copy of its adapters to the outbox (:data:`~pipeline.registry.outbox.ROUNDS`),
    atomically. Returns the round's entry. An existing one is kept as is."""
    box = Outbox(cfg, ROUNDS)
    adapters = box.entry(result.round_id) / "adapters"
    return box.put(
        result.round_id,
        _result_to_json(result, adapters, promote),
        {f"adapters/{cand.name}": cand.adapter_dir for cand in result.candidates},
    )


def list_pending(cfg: HourglassConfig) -> list[str]:
    """Round ids waiting for registration, oldest first."""
    return Outbox(cfg, ROUNDS).pending()


# --- logging and registration -------------------------------------------------------


def _log_candidate(
    client: MlflowClient, experiment_id: str, parent_id: str, result: RoundResult, cand: CandidateResult
) -> str:
    tags = {**lineage_tags(result), TAG_KIND: "candidate", TAG_CANDIDATE: cand.name, "mlflow.parentRunId": parent_id}
    run = client.create_run(experiment_id, tags=tags, run_name=f"{result.round_id}/{cand.name}")
    run_id = run.info.run_id
    params = [Param(k, redact(str(v))[:6000]) for k, v in sorted(cand.recipe.items())]
    metrics = [
        Metric(key, float(value), 0, step) for step, row in enumerate(cand.step_metrics) for key, value in row.items()
    ]
    metrics += [Metric(key, float(value), 0, 0) for key, value in cand.eval_metrics.items()]
    for start in range(0, max(len(metrics), 1), 900):  # log_batch takes at most 1000 entries
        client.log_batch(run_id, metrics=metrics[start : start + 900], params=params if start == 0 else [])
    client.log_artifacts(run_id, str(cand.adapter_dir), artifact_path=ADAPTER_ARTIFACT)
    client.set_terminated(run_id, "FINISHED")
    return run_id


def log_round(client: MlflowClient, experiment: str, result: RoundResult) -> dict[str, str]:
    """Log a round as a parent run and one nested run per candidate (idempotent).

    Returns ``{candidate name: run id}``. A candidate already logged as a
    FINISHED run for this round id is not logged again.

    Raises:
        MlflowException: MLflow refused or could not be reached.
    """
    experiment_id = ensure_experiment(client, experiment)
    done = {
        r.data.tags.get(TAG_CANDIDATE): r.info.run_id
        for r in find_runs(client, experiment_id, result.round_id, "candidate")
    }
    parents = find_runs(client, experiment_id, result.round_id, "round")
    if parents and all(c.name in done for c in result.candidates):
        return {c.name: done[c.name] for c in result.candidates}
    parent = client.create_run(
        experiment_id, tags={**lineage_tags(result), TAG_KIND: "round"}, run_name=result.round_id
    )
    parent_id = parent.info.run_id
    round_metrics = [Metric(k, float(v), 0, 0) for k, v in result.metrics.items()]
    decisions = [Param(f"gate/{m}/winner", redact(str(d.winner))) for m, d in sorted(result.decisions.items())]
    decisions += [Param(f"skipped/{name}", redact(why)[:6000]) for name, why in sorted(result.skipped.items())]
    client.log_batch(parent_id, metrics=round_metrics, params=decisions)
    runs = {}
    for cand in result.candidates:
        runs[cand.name] = done.get(cand.name) or _log_candidate(client, experiment_id, parent_id, result, cand)
    client.set_terminated(parent_id, "FINISHED")
    return runs


def register_winner(
    client: MlflowClient, result: RoundResult, decision: GateDecision, run_id: str, *, signing_key: bytes
) -> RegisteredVersion:
    """Create the model version for a gate winner, or return the one already made.

    The version's tags: the round's lineage, the candidate name,
    ``hourglass.sha256`` with the adapter files' checksums, and
    ``hourglass.signature`` over them made with ``signing_key``
    (:func:`pipeline.registry.signing.sign`), set in the same call that creates the version.
    """
    model = decision.served_model
    cand = next(c for c in result.candidates if c.name == decision.winner)
    existing = find_round_version(client, model, result.round_id)
    if existing is not None:
        return RegisteredVersion(model, str(existing.version), result.round_id, cand.name, existing.run_id or run_id)
    try:
        client.create_registered_model(model, description=f"LoRA adapters served as {model!r} (Hourglass).")
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    tags = {
        **lineage_tags(result),
        TAG_CANDIDATE: cand.name,
        TAG_SHA256: json.dumps(adapter_checksums(cand.adapter_dir)),
    }
    tags[TAG_SIGNATURE] = sign(signing_key, model, tags)
    source = f"{client.get_run(run_id).info.artifact_uri}/{ADAPTER_ARTIFACT}"
    version = client.create_model_version(
        model, source, run_id=run_id, tags=tags, description=redact(decision.reason)[:5000]
    )
    return RegisteredVersion(model, str(version.version), result.round_id, cand.name, run_id)


def _register_now(cfg: HourglassConfig, client: MlflowClient, result: RoundResult) -> list[RegisteredVersion]:
    key = signing_keys(cfg)[0]
    runs = _short_retry(log_round)(client, cfg.registry.experiment, result)
    registered = []
    for decision in result.decisions.values():
        if decision.winner is None:
            continue
        registered.append(
            _short_retry(register_winner)(client, result, decision, runs[decision.winner], signing_key=key)
        )
    return registered


def register_winners(
    cfg: HourglassConfig, result: RoundResult, *, promotion_owed: bool = False, client: MlflowClient | None = None
) -> list[RegisteredVersion]:
    """The ``register`` step: log a round and register each gate winner. Moves no alias.

    Write-ahead: the round is saved to the pending folder first and removed
    once MLflow holds it, so an outage loses nothing. ``promotion_owed`` is
    written into that folder: when this call fails and the round gives up,
    :func:`retry_pending` later registers the folder and runs
    :func:`promote_winners` for it (the round can no longer do so).

    Returns:
        One :class:`RegisteredVersion` per served model whose gate picked a winner.

    Raises:
        RegistryUnavailableError: MLflow could not be reached after short
            retries; the round stays pending for :func:`retry_pending`.
        RegistryError: MLflow refused an operation; the round stays pending.
    """
    round_id = save_pending(cfg, result, promotion_owed).name
    stored, _ = _result_from_json(Outbox(cfg, ROUNDS).read(round_id) or {})
    return _register_entry(cfg, stored, False, client or make_client(cfg))


def register_round(
    cfg: HourglassConfig, result: RoundResult, *, promote: bool = False, client: MlflowClient | None = None
) -> list[RegisteredVersion]:
    """Both steps at once, for callers outside a round (tests, benchmarks, tools): :func:`register_winners`,
    then with ``promote`` :func:`promote_winners` before the pending folder is released (a failed
    promotion stays pending and is retried by :func:`retry_pending`).

    Raises:
        RegistryUnavailableError, RegistryError: as :func:`register_winners`.
    """
    round_id = save_pending(cfg, result, promote).name
    stored, _ = _result_from_json(Outbox(cfg, ROUNDS).read(round_id) or {})
    return _register_entry(cfg, stored, promote, client or make_client(cfg))


def register_pending(
    cfg: HourglassConfig, round_id: str, client: MlflowClient | None = None
) -> list[RegisteredVersion] | None:
    """Register the pending folder of ``round_id`` without moving any alias (crash recovery of a round
    that was in ``register``: its own ``promote`` step follows). None when the round has no pending folder.

    Raises:
        RegistryUnavailableError, RegistryError: as :func:`register_winners`; the folder stays.
    """
    data = Outbox(cfg, ROUNDS).read(round_id)
    if data is None:
        return None
    result, _ = _result_from_json(data)
    return _register_entry(cfg, result, False, client or make_client(cfg))


TAG_NOT_PROMOTED = "hourglass.not_promoted"


def _stale_against_champion(
    cfg: HourglassConfig, client: MlflowClient, model: str, version: str, round_id: str
) -> str | None:
    """Why ``version`` must not become champion (its round is older than the champion's), or None.

    Rounds are ordered by round id (``r<UTC start time>-<hex>``), falling back
    to the lineage tag ``hourglass.window_end`` when a champion has no round tag.
    """
    current = aliases.champion_version(client, model, cfg.registry.champion_alias)
    if current is None or current == version:
        return None
    champ = client.get_model_version(model, current)
    mine = client.get_model_version(model, version)
    champ_round, my_round = champ.tags.get(TAG_ROUND), mine.tags.get(TAG_ROUND, round_id)
    if champ_round and my_round and champ_round > my_round:
        return f"round {my_round} is older than the champion v{current}'s round {champ_round}"
    champ_end, my_end = champ.tags.get(TAG_WINDOW_END), mine.tags.get(TAG_WINDOW_END)
    if not champ_round and champ_end and my_end and champ_end > my_end:
        return f"its data window ends {my_end}, before the champion v{current}'s ({champ_end})"
    return None


def promote_winners(
    cfg: HourglassConfig, round_id: str, versions: Mapping[str, str], *, client: MlflowClient | None = None
) -> list[dict]:
    """The ``promote`` step with the canary off: move ``@champion`` of each served model to its
    registered version, unless a newer round's version is champion already (then the version is
    tagged ``hourglass.not_promoted`` with the reason and the alias stays).

    Idempotent: a version that is champion already stays so (a resumed round moves nothing twice).
    ``versions``: served model -> version. Returns one ``{"model", "version", "action", "reason"}``
    per model, ``action`` ``"promoted"`` or ``"not_promoted"``.

    Raises:
        MlflowException, ConnectionError: MLflow refused or could not be reached (after short retries).
    """
    if not versions:
        return []
    client = client or make_client(cfg)
    outcomes = []
    for model, version in versions.items():
        stale = _short_retry(_stale_against_champion)(cfg, client, model, str(version), round_id)
        if stale is not None:
            reason = f"not promoted: {stale}"
            log.warning("%s v%s %s", model, version, reason)
            _short_retry(client.set_model_version_tag)(model, str(version), TAG_NOT_PROMOTED, reason[:4900])
            outcomes.append({"model": model, "version": str(version), "action": "not_promoted", "reason": stale})
            continue
        _short_retry(aliases.promote)(cfg, model, str(version), client=client, reason=f"round {round_id}")
        outcomes.append({"model": model, "version": str(version), "action": "promoted", "reason": f"round {round_id}"})
    return outcomes


def _register_entry(
    cfg: HourglassConfig, result: RoundResult, promote: bool, client: MlflowClient
) -> list[RegisteredVersion]:
    """Register the round's outbox entry; with ``promote``, run :func:`promote_winners` before the entry goes."""
    box = Outbox(cfg, ROUNDS)
    folder = box.entry(result.round_id)
    try:
        registered = _register_now(cfg, client, result)
        if promote:
            promote_winners(cfg, result.round_id, {v.model: v.version for v in registered}, client=client)
    except Exception as err:
        if _transient(err) or not mlflow_reachable(cfg.registry.tracking_uri):
            raise RegistryUnavailableError(
                f"MLflow at {cfg.registry.tracking_uri} is unreachable ({type(err).__name__}); round "
                f"{result.round_id!r} is kept in {folder} and will be registered by retry_pending()"
            ) from err
        raise RegistryError(
            f"MLflow refused to register round {result.round_id!r}: {err}; the round is kept in {folder}"
        ) from err
    box.done(result.round_id)
    return registered


def retry_pending(cfg: HourglassConfig, client: MlflowClient | None = None) -> list[RegisteredVersion]:
    """Register every pending round, oldest first; stops at the first outage.

    Called at start-up and every ``schedule.pending_retry_interval_s`` by the
    service (while no round runs). A pending round that still owes its
    promotion (its round gave up at ``register``) is promoted by
    :func:`promote_winners`: only if it is not older than the current
    champion's round; otherwise it is registered, tagged
    ``hourglass.not_promoted`` with the reason, and the alias stays.

    Returns the versions registered in this call (already-registered ones
    included, found by their round id tag). Rounds MLflow refuses stay pending
    and are logged.
    """
    if not list_pending(cfg):
        return []
    client = client or make_client(cfg)
    registered: list[RegisteredVersion] = []
    for round_id in list_pending(cfg):
        result, promote = _result_from_json(Outbox(cfg, ROUNDS).read(round_id) or {})
        try:
            registered += _register_entry(cfg, result, promote, client)
        except RegistryUnavailableError:
            log.warning("MLflow still unreachable; %d round(s) stay pending", len(list_pending(cfg)))
            break
        except RegistryError as err:
            log.error("%s", err)
    return registered
