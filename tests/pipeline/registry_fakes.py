"""In-memory stand-ins for the unit tests of the control plane's logic (no MLflow, no vLLM).

- :class:`FakeRegistry`: the ``MlflowClient`` calls Hourglass makes on the model registry
  (versions, version tags, registered-model tags, aliases), with MLflow's error codes.
- :class:`FakeReplica`: a vLLM replica as :class:`pipeline.serving.replica.ReplicaControl` sees it
  (loaded adapter names; scripted faults; a restart that loses every runtime adapter).
- :class:`FakeStager`: the staging step of :class:`pipeline.serving.controller.ServingController`
  (no download; refuses the versions it is told to).

Each fake records the calls made to it, so a test can assert what the logic decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST

from pipeline.serving.replica import ReplicaRefusedError, ReplicaUnreachableError
from pipeline.serving.staging import StagedAdapter, StagingError, served_name


@dataclass
class _Model:
    tags: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    versions: dict[str, dict[str, str]] = field(default_factory=dict)  # version -> its tags


class FakeRegistry:
    """An ``MlflowClient`` for the registry calls of :mod:`pipeline.registry.aliases`, :mod:`pipeline.serving.controller`
    and :mod:`pipeline.canary.state`. ``down = True`` makes every call raise like an unreachable server."""

    def __init__(self) -> None:
        self.models: dict[str, _Model] = {}
        self.down = False
        self.calls: list[tuple[Any, ...]] = []

    # --- set-up helpers (not MlflowClient API) ----------------------------------------

    def add_versions(self, model: str, count: int, **tags: str) -> list[str]:
        """Register ``count`` new versions of ``model`` (each with ``tags``); returns their numbers."""
        entry = self.models.setdefault(model, _Model())
        out = []
        for _ in range(count):
            version = str(len(entry.versions) + 1)
            entry.versions[version] = dict(tags)
            out.append(version)
        return out

    def alias(self, model: str, alias: str) -> str | None:
        return self.models[model].aliases.get(alias)

    def tags(self, model: str, version: str) -> dict[str, str]:
        return self.models[model].versions[version]

    # --- MlflowClient API ---------------------------------------------------------------

    def _model(self, name: str, op: str, *args: Any) -> _Model:
        self.calls.append((op, name, *args))
        if self.down:
            raise MlflowException(f"API request to http://mlflow.invalid failed: connection refused ({op})")
        if name not in self.models:
            raise MlflowException(f"Registered Model with name={name} not found", RESOURCE_DOES_NOT_EXIST)
        return self.models[name]

    def _version(self, name: str, version: str, op: str, *args: Any) -> dict[str, str]:
        entry = self._model(name, op, version, *args)
        if str(version) not in entry.versions:
            raise MlflowException(f"Model Version (name={name}, version={version}) not found", RESOURCE_DOES_NOT_EXIST)
        return entry.versions[str(version)]

    def _entity(self, name: str, version: str) -> SimpleNamespace:
        entry = self.models[name]
        return SimpleNamespace(
            name=name,
            version=str(version),
            tags=dict(entry.versions[str(version)]),
            run_id=f"run-{version}",
            creation_timestamp=int(version),
            aliases=[a for a, v in entry.aliases.items() if v == str(version)],
        )

    def get_model_version(self, name: str, version: str) -> SimpleNamespace:
        self._version(name, version, "get_model_version")
        return self._entity(name, version)

    def get_model_version_by_alias(self, name: str, alias: str) -> SimpleNamespace:
        entry = self._model(name, "get_model_version_by_alias", alias)
        if alias not in entry.aliases:
            raise MlflowException(f"Registered model alias {alias} not found.", INVALID_PARAMETER_VALUE)
        return self._entity(name, entry.aliases[alias])

    def set_model_version_tag(self, name: str, version: str, key: str, value: str) -> None:
        self._version(name, version, "set_model_version_tag", key)[key] = str(value)

    def delete_model_version_tag(self, name: str, version: str, key: str) -> None:
        tags = self._version(name, version, "delete_model_version_tag", key)
        if key not in tags:
            raise MlflowException(f"No tag with name: {key}", RESOURCE_DOES_NOT_EXIST)
        del tags[key]

    def get_registered_model(self, name: str) -> SimpleNamespace:
        entry = self._model(name, "get_registered_model")
        return SimpleNamespace(name=name, tags=dict(entry.tags), aliases=dict(entry.aliases))

    def set_registered_model_tag(self, name: str, key: str, value: str) -> None:
        self._model(name, "set_registered_model_tag", key).tags[key] = str(value)

    def set_registered_model_alias(self, name: str, alias: str, version: str) -> None:
        self._version(name, version, "set_registered_model_alias", alias)
        self.models[name].aliases[alias] = str(version)

    def delete_registered_model_alias(self, name: str, alias: str) -> None:
        self._model(name, "delete_registered_model_alias", alias).aliases.pop(alias, None)  # MLflow: absent is fine

    def search_model_versions(self, filter_string: str) -> list[SimpleNamespace]:
        name = filter_string.split("'")[1]
        entry = self._model(name, "search_model_versions")
        return [self._entity(name, v) for v in entry.versions]


class FakeReplica:
    """A vLLM replica: ``loaded`` adapter names beside the base ``"base"``.

    ``fail(op, *errors)`` scripts the next calls of ``op`` (``"models"``, ``"load"``,
    ``"probe"``, ``"unload"``): each call raises the next error (None = succeed).
    ``refuse[name]`` makes every load of ``name`` a 4xx (the adapter's fault);
    ``broken[name]`` makes every probe through ``name`` fail as a NaN adapter does.
    ``down = True``: nothing answers. :meth:`restart` loses the runtime adapters.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.loaded: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.down = False
        self.refuse: dict[str, str] = {}
        self.broken: set[str] = set()
        self._script: dict[str, list[Exception | None]] = {}

    def fail(self, op: str, *errors: Exception | None) -> None:
        self._script.setdefault(op, []).extend(errors)

    def restart(self) -> None:
        self.loaded.clear()

    def _enter(self, op: str, name: str = "") -> None:
        self.calls.append((op, name))
        if self.down:
            raise ReplicaUnreachableError(f"vLLM at {self.url} did not answer {op}: ConnectError")
        script = self._script.get(op)
        if script:
            err = script.pop(0)
            if err is not None:
                raise err

    def models(self) -> list[str]:
        self._enter("models")
        return ["base", *sorted(self.loaded)]

    def load(self, name: str, path: str) -> None:
        self._enter("load", name)
        if name in self.refuse:
            raise ReplicaRefusedError(f"vLLM at {self.url} refused load {name!r}: HTTP 400: {self.refuse[name]}")
        self.loaded.add(name)

    def unload(self, name: str) -> None:
        self._enter("unload", name)
        self.loaded.discard(name)

    def probe(self, name: str) -> str:
        self._enter("probe", name)
        if name not in self.loaded:
            raise ReplicaRefusedError(f"vLLM at {self.url} refused a probe through {name!r}: HTTP 404: not found")
        if name in self.broken:
            raise ReplicaRefusedError(f"vLLM at {self.url}: the probe through {name!r} has non-finite logprobs [nan]")
        return "probe text"

    def close(self) -> None:
        self.calls.append(("close", ""))

    def ops(self, op: str) -> list[str]:
        """The names ``op`` was called with, in order."""
        return [name for o, name in self.calls if o == op]


class FakeStager:
    """Stages nothing: returns the folder a real stage would use, or refuses ``refuse[(model, version)]``."""

    def __init__(self) -> None:
        self.refuse: dict[tuple[str, str], str] = {}
        self.calls: list[tuple[str, str]] = []

    def __call__(self, client: Any, model: str, version: str, staging_dir: Path, **kwargs: Any) -> StagedAdapter:
        self.calls.append((model, str(version)))
        reason = self.refuse.get((model, str(version)))
        if reason is not None:
            raise StagingError(f"{model} v{version}: {reason}")
        return StagedAdapter(
            model, str(version), Path(staging_dir) / model / f"v{version}", 8, served_name(model, str(version))
        )
