"""The registry's leaf: the MLflow client factory, the registry errors, the
transient-error retry policy and the tag names every registry module shares.

It imports nothing else from the registry, so the modules that register
versions (:mod:`pipeline.registry.models`) and the modules that move aliases
(:mod:`pipeline.registry.aliases`) both import it without importing each other.
Source: ``mlflow.tracking.MlflowClient`` and MLflow's HTTP retry settings
(``MLFLOW_HTTP_REQUEST_*`` environment variables).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from pipeline.config import HourglassConfig
from pipeline.errors import PipelineError
from trainer.model.store import sha256_file
from trainer.types import RoundResult

TAG_ROUND = "hourglass.round_id"
TAG_WINDOW_START = "hourglass.window_start"
TAG_WINDOW_END = "hourglass.window_end"
TAG_TRACES = "hourglass.trace_count"
TAG_FINGERPRINT = "hourglass.base_fingerprint"
TAG_CANDIDATE = "hourglass.candidate"
TAG_SHA256 = "hourglass.sha256"
TAG_KIND = "hourglass.run_kind"  # "round" | "candidate" | "reward_model"


class RegistryError(PipelineError, RuntimeError):
    """MLflow refused a registry operation (the message says which and why)."""


class RegistryUnavailableError(RegistryError, ConnectionError):
    """MLflow could not be reached; the round waits in the pending folder."""


def make_client(cfg: HourglassConfig) -> MlflowClient:
    """An ``MlflowClient`` on ``registry.tracking_uri``.

    MLflow's own HTTP retry defaults (7 retries, exponential backoff) would
    stall a round for minutes when the server is down; unless the operator set
    them, they are lowered so our tenacity policy and the pending folder do
    the waiting instead.
    """
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return MlflowClient(tracking_uri=cfg.registry.tracking_uri, registry_uri=cfg.registry.tracking_uri)


def mlflow_reachable(tracking_uri: str, timeout_s: float = 2.0) -> bool:
    """True when ``GET {tracking_uri}/health`` answers 200 (always True for non-HTTP URIs)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return True
    try:
        return httpx.get(f"{tracking_uri.rstrip('/')}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def transient(err: BaseException) -> bool:
    """True for errors a retry may cure: connection errors and MLflow's "temporarily unavailable"."""
    if isinstance(err, (ConnectionError, httpx.HTTPError)):
        return True
    if isinstance(err, MlflowException):
        text = str(err)
        return err.error_code == "TEMPORARILY_UNAVAILABLE" or "Max retries exceeded" in text or "Connection" in text
    return type(err).__module__.startswith(("requests", "urllib3"))


# Short retries for a blip; a longer outage is the pending folder's job.
short_retry = retry(
    retry=retry_if_exception(transient),
    stop=stop_after_attempt(3),
    wait=wait_exponential(multiplier=0.5, max=2),
    reraise=True,
)


# --- what every registration reads and writes ------------------------------------------------


def lineage_tags(result: RoundResult) -> dict[str, str]:
    """The tags every registration of a round carries: its id, data window, trace count and base fingerprint."""
    return {
        TAG_ROUND: result.round_id,
        TAG_WINDOW_START: result.window_start.isoformat(),
        TAG_WINDOW_END: result.window_end.isoformat(),
        TAG_TRACES: str(result.train_rows + result.heldout_rows),
        TAG_FINGERPRINT: result.base_fingerprint,
    }


def adapter_checksums(adapter_dir: Path) -> dict[str, str]:
    """``{file name: sha256 hex}`` of every regular file in an adapter folder (not recursive)."""
    return {p.name: sha256_file(p) for p in sorted(Path(adapter_dir).iterdir()) if p.is_file() and not p.is_symlink()}


def ensure_experiment(client: MlflowClient, name: str) -> str:
    """The id of experiment ``name``, created when missing (concurrently created ones are found)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # created concurrently
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def find_runs(client: MlflowClient, experiment_id: str, round_id: str, kind: str) -> list:
    """The FINISHED runs of ``round_id`` of one kind (``round``, ``candidate``, ``reward_model``)."""
    query = f"tags.`{TAG_ROUND}` = '{round_id}' and tags.`{TAG_KIND}` = '{kind}' and attributes.status = 'FINISHED'"
    return client.search_runs([experiment_id], filter_string=query, max_results=1000)


def find_round_version(client: MlflowClient, model: str, round_id: str):
    """The model version registered for ``round_id`` under ``model``, or None (also when ``model`` does not
    exist yet): what makes every registration step idempotent by the round id tag."""
    try:
        versions = client.search_model_versions(f"name = '{model}' and tags.`{TAG_ROUND}` = '{round_id}'")
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return versions[0] if versions else None
