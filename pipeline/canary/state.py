"""The canary's state in the MLflow registry: the ``@challenger`` alias and version tags.

Everything that must survive a restart lives in MLflow, never in memory:

- alias ``serving.canary.alias`` (default ``challenger``): the version on canary;
- ``hourglass.canary_started_at`` (ISO 8601, UTC) on that version: set when its
  route first carried traffic; the evidence is read from the buffer since then;
- ``hourglass.canary_result`` on that version: JSON ``{"decision", "reason", "evidence", "at"}``
  once the canary ended (promoted or aborted);
- ``hourglass.guard`` on a version promoted by a canary: JSON ``{"since", "until",
  "previous", "baseline": {n, mean, var}}`` for the post-promotion guard, and
  ``hourglass.guard_result`` once the guard passed, rolled back, or ended on a tag it could not read.

Source: MLflow model registry aliases and tags (``MlflowClient``).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta, timezone

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pipeline.registry import aliases
from pipeline.config import HourglassConfig
from pipeline.registry.models import RegistryError, make_client

log = logging.getLogger(__name__)

TAG_STARTED = "hourglass.canary_started_at"
TAG_RESULT = "hourglass.canary_result"
TAG_GUARD = "hourglass.guard"
TAG_GUARD_RESULT = "hourglass.guard_result"


class NoCanaryError(RegistryError, LookupError):
    """The model has no version on canary (no ``@challenger`` alias)."""


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def challenger_version(client: MlflowClient, cfg: HourglassConfig, model: str) -> str | None:
    """The version ``@challenger`` points at, or None."""
    return aliases.champion_version(client, model, cfg.serving.canary.alias)


def _drop_alias(client: MlflowClient, cfg: HourglassConfig, model: str) -> None:
    try:
        client.delete_registered_model_alias(model, cfg.serving.canary.alias)
    except MlflowException as err:
        if err.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            raise


def _tag_json(client: MlflowClient, model: str, version: str, key: str, data: dict) -> None:
    client.set_model_version_tag(model, version, key, json.dumps(data, default=str)[:4900])


def promote_or_challenge(
    cfg: HourglassConfig, model: str, version: str, *, client: MlflowClient | None = None, reason: str = "round"
) -> dict:
    """What a round does with its winner. Returns ``{"model", "version", "action", "reason"}``, action one of:

    - ``"promoted"``: canary disabled: ``@champion`` moved at once (:func:`pipeline.registry.aliases.promote`);
    - ``"challenger"``: ``@challenger`` now points at it (the outcome's ``control`` says against what:
      the champion's version, or ``"base"``); the serving controller loads it
      beside the champion, or beside the base model when there is no ``@champion`` yet (the
      first winner is compared with what serves the users today), and the canary monitor decides;
    - ``"not_started"``: another version is on canary; the winner stays registered, not
      served (promote or challenge it by hand, or let the next round's winner try).

    Raises:
        UnknownVersionError: no such version. MlflowException: MLflow unreachable.
    """
    client = client or make_client(cfg)
    version = str(version)
    champion = aliases.champion_version(client, model, cfg.registry.champion_alias)
    if not cfg.serving.canary.enabled:
        aliases.promote(cfg, model, version, client=client, reason=reason)
        return {"model": model, "version": version, "action": "promoted", "reason": "canary disabled"}
    if champion == version:
        return {"model": model, "version": version, "action": "promoted", "reason": "already the champion"}
    running = challenger_version(client, cfg, model)
    if running == version:  # e.g. a resumed round: keep the canary's start time and evidence
        return {
            "model": model,
            "version": version,
            "action": "challenger",
            "reason": "already on canary",
            "control": "base" if champion is None else champion,
        }
    if running is not None:
        return {
            "model": model,
            "version": version,
            "action": "not_started",
            "reason": f"v{running} is on canary; v{version} stays registered (promote it by hand or wait for the next round)",
        }
    out = start_challenger(cfg, model, version, client=client, reason=reason)
    return {**out, "control": "base" if champion is None else champion}


def describe(outcomes: list[dict]) -> str:
    """One line for a round record: what happened to each winner (a canary against the base, i.e. with no
    champion yet, says so)."""
    words = {
        "promoted": "promoted {model} v{version}",
        "challenger": "{model} v{version} on canary",
        "not_started": "{model} v{version} registered, no canary: {reason}",
    }
    return ", ".join(
        words[o["action"]].format(**o) + (" against the base" if o.get("control") == "base" else "") for o in outcomes
    )


def start_challenger(
    cfg: HourglassConfig, model: str, version: str, *, client: MlflowClient | None = None, reason: str = "manual"
) -> dict:
    """Point ``@challenger`` at ``version`` and clear its previous canary tags (a fresh start).

    Raises:
        UnknownVersionError: no such version.
    """
    client = client or make_client(cfg)
    mv = aliases._require_version(client, model, str(version))
    for tag in (TAG_STARTED, TAG_RESULT, aliases.TAG_SERVE_ERROR):
        if tag in mv.tags:
            client.delete_model_version_tag(model, str(version), tag)
    client.set_registered_model_alias(model, cfg.serving.canary.alias, str(version))
    log.info("%s v%s is the challenger (%s)", model, version, reason)
    return {"model": model, "version": str(version), "action": "challenger", "reason": reason}


def mark_started(
    client: MlflowClient, model: str, version: str, when: str | None = None, *, restart: bool = False
) -> str:
    """Record when the canary's traffic started (kept if already set, unless ``restart``); returns the ISO time."""
    mv = client.get_model_version(model, version)
    if TAG_STARTED in mv.tags and not restart:
        return mv.tags[TAG_STARTED]
    when = when or now_iso()
    client.set_model_version_tag(model, version, TAG_STARTED, when)
    return when


def promote_challenger(
    cfg: HourglassConfig,
    model: str,
    *,
    client: MlflowClient | None = None,
    reason: str = "manual",
    evidence: dict | None = None,
) -> dict:
    """Move ``@champion`` to the challenger and drop ``@challenger``; arm the guard when evidence
    of the old champion is known. Returns ``{"model", "version", "previous", "decision"}``.

    A challenger compared with the base (no champion before: ``previous`` None) arms no guard:
    the base is not a registered version a rollback could return to.

    Raises:
        NoCanaryError: no version is on canary.
    """
    client = client or make_client(cfg)
    version = challenger_version(client, cfg, model)
    if version is None:
        raise NoCanaryError(
            f"model {model!r} has no version on canary (no @{cfg.serving.canary.alias}); see `hourglass canary status`"
        )
    out = aliases.promote(cfg, model, version, client=client, reason=f"canary: {reason}"[:200])
    _drop_alias(client, cfg, model)
    _tag_json(
        client,
        model,
        version,
        TAG_RESULT,
        {"decision": "promote", "reason": reason, "evidence": evidence, "at": now_iso()},
    )
    baseline = (evidence or {}).get("champion")
    if cfg.serving.guard.enabled and out["previous"] is not None and baseline and baseline.get("n"):
        since = datetime.now(timezone.utc)
        until = since + timedelta(seconds=cfg.serving.guard.period_s)
        _tag_json(
            client,
            model,
            version,
            TAG_GUARD,
            {
                "since": since.isoformat(timespec="milliseconds"),
                "until": until.isoformat(timespec="seconds"),
                "previous": out["previous"],
                "baseline": baseline,
            },
        )
    return {**out, "decision": "promote"}


def abort_challenger(
    cfg: HourglassConfig,
    model: str,
    *,
    client: MlflowClient | None = None,
    reason: str = "manual",
    evidence: dict | None = None,
) -> dict:
    """Drop ``@challenger`` and tag the version with the reason and evidence; ``@champion`` does not move.

    Returns ``{"model", "version", "decision"}``.

    Raises:
        NoCanaryError: no version is on canary.
    """
    client = client or make_client(cfg)
    version = challenger_version(client, cfg, model)
    if version is None:
        raise NoCanaryError(
            f"model {model!r} has no version on canary (no @{cfg.serving.canary.alias}); see `hourglass canary status`"
        )
    _drop_alias(client, cfg, model)
    _tag_json(
        client,
        model,
        version,
        TAG_RESULT,
        {"decision": "abort", "reason": reason, "evidence": evidence, "at": now_iso()},
    )
    log.warning("canary of %s v%s aborted: %s", model, version, reason)
    return {"model": model, "version": version, "decision": "abort"}


def read_json_tag(tags: dict, key: str) -> dict | None:
    try:
        return json.loads(tags[key]) if key in tags else None
    except ValueError:
        return None
