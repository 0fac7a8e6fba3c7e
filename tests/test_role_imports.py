"""Each role's entry point imports only its role's packages (docs/scaling.md#extras-per-role).

A subprocess imports the role's modules and runs its ``hourglass`` commands with ``--help`` (the
roles are in ``tests/roles.py``); every third-party module then in ``sys.modules`` must come from a
distribution the role's extra installs (the core dependencies, the extra, what they require,
transitively, as installed here). An import of torch, vLLM, Ray or MLflow at the top of a module the
gateway reaches fails here, on every run, without installing anything; ``test_role_installs.py``
installs each extra alone from its lock."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest

from tests import REPO
from packaging.requirements import Requirement

from tests.roles import CLI, PYPROJECT, ROLES, Role, _canonical, closure, declared

# Every distribution pyproject.toml names (the core, each extra, the vLLM builds): the packages a role may
# lack. A transitive dependency that a library imports only when it is installed (httpx -> zstandard, fastapi ->
# email-validator) is not a role's choice and not checked here: the install test catches a missing one.
NAMED = {
    _canonical(Requirement(text).name)
    for texts in [PYPROJECT["dependencies"], *PYPROJECT["optional-dependencies"].values()]
    for text in texts
} - {"hourglass"}
# Named by an extra, and imported by a library of another role when installed (not needed there).
OPPORTUNISTIC = {
    "numpy": "pyarrow converts to and from numpy when numpy is installed; it does not require it",
    "zstandard": "httpx decodes zstd responses when zstandard is installed",
    "snappy": "prometheus-client compresses remote-write payloads with python-snappy when it is installed",
    "lz4": "joblib (transformers -> scikit-learn) compresses with lz4 when it is installed",
}
# What the gateway and the bare command line must never load, whatever the extras say (the issue's own words).
NEVER = {
    "gateway": {"torch", "vllm", "ray", "transformers", "mlflow", "peft"},
    "": {"torch", "vllm", "ray", "transformers", "mlflow", "peft", "pyarrow", "fastapi", "kafka"},
}

PROBE = r"""
import contextlib, importlib, io, json, sys
modules, commands = json.loads(sys.argv[1])
for name in modules:
    importlib.import_module(name)
if commands:
    from pipeline.cli.main import app
    for args in commands:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                app([*args, "--help"], standalone_mode=False)
            except SystemExit as stop:
                assert not stop.code, (args, stop.code)
        assert "Usage" in out.getvalue(), (args, out.getvalue()[-500:])
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def imported(role: Role) -> set[str]:
    """Top-level modules in ``sys.modules`` after the role's entry point and ``--help`` runs."""
    run = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([role.modules, role.commands])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return set(json.loads(run.stdout.strip().splitlines()[-1]))


def violations(role: Role, modules: set[str]) -> dict[str, list[str]]:
    """Each imported module of a distribution pyproject.toml names that the role's extra does not install
    (not in its closure), with that distribution."""
    allowed = closure(declared(role.extra))
    owners = metadata.packages_distributions()
    bad = {}
    for module in sorted(modules - set(sys.stdlib_module_names) - set(OPPORTUNISTIC)):
        dists = {_canonical(d) for d in owners.get(module, [])}
        if dists & NAMED and not dists & allowed:
            bad[module] = sorted(dists)
    return bad


IMPORT_TORCH = ("trainer", "ray", "service")


# `all` is left out: it installs every role (nothing to forbid but vLLM, which only vLLM's own processes load).
# The heavy roles import torch (15-35 s on a loaded 2-core host): marked integration, out of `make test-unit`.
@pytest.mark.parametrize(
    "name",
    [
        "cli",
        *(pytest.param(r, marks=pytest.mark.integration) if r in IMPORT_TORCH else r for r in ROLES if r != "all"),
    ],
)
def test_role_entry_imports_only_its_extra(name: str) -> None:
    role = CLI if name == "cli" else ROLES[name]
    modules = imported(role)
    assert violations(role, modules) == {}, f"{name}: imports outside its extra {role.extra or '(core)'}"
    never = NEVER.get(role.extra, set())
    assert not modules & never, sorted(modules & never)


def test_the_probe_sees_a_forbidden_import() -> None:
    """The check can fail: the gateway role's closure does not cover MLflow, so a module importing it is a violation."""
    role = ROLES["gateway"]
    assert list(violations(role, {"mlflow", "fastapi", "json"})) == ["mlflow"]
    assert "kafka" in violations(CLI, imported(Role("", ("kafka",), ())))
