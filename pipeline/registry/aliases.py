"""Alias moves on the registered model: promote, rollback, and the champion history.

``@champion`` (``registry.champion_alias``) marks the version that must be
served; the serving controller reconciles vLLM to it. The registered model's
tag ``hourglass.champion_history`` (JSON list of versions, oldest first, at
most 50) remembers what was champion before, and the alias
``previous-champion`` points at the version a plain :func:`rollback` returns
to. A version that failed to serve carries ``hourglass.serve_error``; rollback
skips it, and an explicit promote clears it (the operator asks for a retry).

These functions are what the CLI and the ops API call. Source: MLflow model
registry aliases (``MlflowClient.set_registered_model_alias``).
"""

from __future__ import annotations

import json
import time

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pipeline.config import HourglassConfig
from pipeline.redact import redact
from pipeline.registry.client import RegistryError, make_client

TAG_HISTORY = "hourglass.champion_history"
TAG_SERVE_ERROR = "hourglass.serve_error"
TAG_PROMOTED_BY = "hourglass.promoted_reason"
PREVIOUS_ALIAS = "previous-champion"
_HISTORY_MAX = 50


class UnknownVersionError(RegistryError, LookupError):
    """A model or version named by the caller does not exist in the registry."""


def champion_version(client: MlflowClient, model: str, alias: str) -> str | None:
    """The version ``@alias`` points at, or None when the alias or model is absent.

    Raises:
        MlflowException: MLflow could not be reached.
    """
    try:
        return str(client.get_model_version_by_alias(model, alias).version)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def history(client: MlflowClient, model: str) -> list[str]:
    """The champion history of ``model``, oldest first ([] when none)."""
    raw = client.get_registered_model(model).tags.get(TAG_HISTORY)
    try:
        return [str(v) for v in json.loads(raw)] if raw else []
    except ValueError:
        return []


def _set_history(client: MlflowClient, model: str, versions: list[str]) -> None:
    client.set_registered_model_tag(model, TAG_HISTORY, json.dumps(versions[-_HISTORY_MAX:]))


def _set_previous(client: MlflowClient, model: str, version: str | None) -> None:
    if version is None:
        try:
            client.delete_registered_model_alias(model, PREVIOUS_ALIAS)
        except MlflowException:
            pass
    else:
        client.set_registered_model_alias(model, PREVIOUS_ALIAS, version)


def _check_version_number(model: str, version: str) -> str:
    """``version`` when it is a version number MLflow can hold (digits, int64), else UnknownVersionError."""
    if not (version.isdigit() and version.isascii() and len(version) <= 18):  # MLflow answers 500 past int64
        raise UnknownVersionError(
            f"version {version[:40]!r} of model {model[:200]!r} is not a version number (digits, at most 18); "
            "see `hourglass models list` for the versions"
        )
    return version


def _require_version(client: MlflowClient, model: str, version: str):
    version = _check_version_number(model, str(version))
    try:
        return client.get_model_version(model, version)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise UnknownVersionError(
                f"model {model!r} has no version {version!r}; see `hourglass models list` for the versions"
            ) from err
        raise


def promote(
    cfg: HourglassConfig, model: str, version: str, *, client: MlflowClient | None = None, reason: str = "manual"
) -> dict:
    """Move ``@champion`` of ``model`` to ``version``; the old champion becomes ``previous-champion``.

    Clears the version's ``hourglass.serve_error`` tag (an explicit promote is
    a request to try again). Returns ``{"model", "version", "previous"}``.

    Raises:
        UnknownVersionError: no such model or version.
        MlflowException: MLflow could not be reached.
    """
    client = client or make_client(cfg)
    version = str(version)
    mv = _require_version(client, model, version)
    if TAG_SERVE_ERROR in mv.tags:
        client.delete_model_version_tag(model, version, TAG_SERVE_ERROR)
    alias = cfg.registry.champion_alias
    current = champion_version(client, model, alias)
    past = history(client, model)
    if current is not None and (not past or past[-1] != current):
        past.append(current)  # the alias was moved by someone else: remember it
    if current != version:
        _set_previous(client, model, current)
        past.append(version)
    _set_history(client, model, past)
    client.set_model_version_tag(
        model, version, TAG_PROMOTED_BY, f"{reason} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    )
    client.set_registered_model_alias(model, alias, version)
    return {"model": model, "version": version, "previous": current}


def rollback(cfg: HourglassConfig, model: str, to: str | None = None, *, client: MlflowClient | None = None) -> dict:
    """Move ``@champion`` back: to ``to``, or to the most recent earlier champion that served fine.

    Returns ``{"model", "version", "previous"}`` (``previous`` = the champion
    before the rollback).

    Raises:
        UnknownVersionError: ``to`` does not exist.
        RegistryError: no earlier champion is known (the message says what serves now: with no
            champion, the base, and a version on canary if one runs); name one with ``to``.
    """
    if to is not None:
        _check_version_number(model, str(to))  # before any MLflow call
    client = client or make_client(cfg)
    alias = cfg.registry.champion_alias
    current = champion_version(client, model, alias)
    past = history(client, model)
    if to is not None:
        target = str(to)
        mv = _require_version(client, model, target)
        if TAG_SERVE_ERROR in mv.tags:
            client.delete_model_version_tag(model, target, TAG_SERVE_ERROR)
    else:
        earlier = next(
            (
                v
                for v in reversed(past)
                if v != current and TAG_SERVE_ERROR not in client.get_model_version(model, v).tags
            ),
            None,
        )
        if earlier is None:
            raise RegistryError(_nothing_to_roll_back(client, cfg, model, current, past))
        target = earlier
    if target in past:
        past = past[: len(past) - past[::-1].index(target)]  # cut after the last occurrence of target
    else:
        past.append(target)
    _set_history(client, model, past)
    _set_previous(client, model, past[-2] if len(past) >= 2 else None)
    client.set_registered_model_alias(model, alias, target)
    return {"model": model, "version": target, "previous": current}


def _nothing_to_roll_back(
    client: MlflowClient, cfg: HourglassConfig, model: str, current: str | None, past: list[str]
) -> str:
    """Why a plain rollback of ``model`` has no target: what serves now and what the operator can do."""
    if current is not None:
        return (
            f"model {model!r} has no earlier champion to roll back to (history {past}, champion v{current}; "
            "the base model is not a registered version, so a rollback cannot return to it); name one with --to VERSION"
        )
    on_canary = champion_version(client, model, cfg.serving.canary.alias)
    canary = (
        f"; v{on_canary} is on canary (@{cfg.serving.canary.alias}) beside the base: "
        "`hourglass canary abort` ends that canary, `hourglass canary promote` makes it the champion"
        if on_canary is not None
        else ""
    )
    return (
        f"model {model!r} has no champion: the base model serves it, so there is nothing to roll back{canary}; "
        "nothing was changed (name a version with --to VERSION to serve it)"
    )


def revert_failed(
    client: MlflowClient, cfg: HourglassConfig, model: str, failed: str, reason: str, last_good: str | None
) -> None:
    """Mark ``failed`` unservable and move ``@champion`` back to ``last_good`` (or drop the alias).

    Called by the serving controller after a stage, load or probe failure.
    The alias is only moved if it still points at ``failed``.
    """
    client.set_model_version_tag(model, failed, TAG_SERVE_ERROR, redact(reason)[:4900])
    alias = cfg.registry.champion_alias
    if champion_version(client, model, alias) != failed:
        return
    past = [v for v in history(client, model) if v != failed]
    if last_good is None:
        client.delete_registered_model_alias(model, alias)
    else:
        if not past or past[-1] != last_good:
            past.append(last_good)
        client.set_registered_model_alias(model, alias, last_good)
    _set_history(client, model, past)
    _set_previous(client, model, past[-2] if len(past) >= 2 else None)


def describe_model(client: MlflowClient, model: str) -> dict:
    """Versions, aliases, lineage tags and serve errors of a registered model, as plain JSON data."""
    registered = client.get_registered_model(model)
    aliases = dict(registered.aliases or {})
    by_version: dict[str, list[str]] = {}
    for name, version in aliases.items():
        by_version.setdefault(str(version), []).append(name)
    versions = sorted(client.search_model_versions(f"name = '{model}'"), key=lambda v: int(v.version))
    return {
        "model": model,
        "aliases": {k: str(v) for k, v in aliases.items()},
        "champion_history": history(client, model),
        "versions": [
            {
                "version": str(v.version),
                "aliases": sorted(by_version.get(str(v.version), [])),
                "run_id": v.run_id,
                "created_ms": v.creation_timestamp,
                "tags": dict(v.tags),
            }
            for v in versions
        ],
    }
