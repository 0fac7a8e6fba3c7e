"""Each role's extra installs alone, from its lock, and its entry point runs (docs/scaling.md#extras-per-role).

For every role of ``tests/roles.py``: a fresh venv (no pip of its own: this environment's pip installs into it
with ``--python``), ``pip install --no-deps --require-hashes -r deploy/locks/ROLE.lock``, the project's wheel
with ``--no-deps`` (what ``pip install hourglass[ROLE]`` installs, at the locked versions), then the role's
modules are imported and its ``hourglass`` commands run with ``--help`` in that venv. A module reached by a
role's entry point that needs a package the extra does not install fails here with its ImportError. The
gateway's venv holds none of torch, vLLM, Ray, transformers or MLflow.

pip's cache (``~/.cache/pip``, filled by deploy/setup.sh) makes the installs local. The light roles (gateway,
ingest, console) take seconds and run in every ``make test``. The heavy ones unpack 0.8-3 GiB (torch, Ray, the
MLflow server, vLLM): minutes each, more than the CI budget allows, so they are marked integration and run only
with ``HOURGLASS_TEST_ROLE_INSTALLS=all`` (``HOURGLASS_TEST_ROLE_INSTALLS=all pytest -s tests/test_role_installs.py``
before a release or after changing an extra). Each test prints its venv's site-packages size (``-s`` shows it;
the table in docs/scaling.md#extras-per-role)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import REPO
from tests.roles import ROLES, Role

GATEWAY_NEVER = ("torch", "vllm", "ray", "transformers", "peft", "mlflow")
PROBE = r"""
import importlib, importlib.util, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps([m for m in json.loads(sys.argv[2]) if importlib.util.find_spec(m) is not None]))
"""


@pytest.fixture(scope="module")
def project_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built once (no build isolation: setuptools comes from this environment)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("hourglass-*.whl")
    return wheel


def _size_mb(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) >> 20


def _install(role: str, venv: Path, wheel: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps"]
    links = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []  # the CPU torch wheel, as setup
    lock = REPO / "deploy" / "locks" / f"{role}.lock"
    # No PYTHONPATH: with the checkout on it, pip would take the project (its egg-info) as installed already.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for args in ([*links, "--require-hashes", "-r", str(lock)], [str(wheel)]):
        run = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=900, env=env)
        assert run.returncode == 0, run.stderr[-3000:]


def _run(venv: Path, args: list[str], cwd: Path) -> str:
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{args}: {run.stderr[-3000:]}"
    return run.stdout


HEAVY = pytest.mark.skipif(
    os.environ.get("HOURGLASS_TEST_ROLE_INSTALLS") != "all",
    reason="a heavy role's install takes minutes: set HOURGLASS_TEST_ROLE_INSTALLS=all to run it",
)


@pytest.mark.parametrize(
    "name", [pytest.param(r, marks=[pytest.mark.integration, HEAVY]) if ROLES[r].heavy else r for r in ROLES]
)
def test_role_installs_from_its_lock_and_runs(name: str, project_wheel: Path, tmp_path: Path) -> None:
    role: Role = ROLES[name]
    venv = tmp_path / "venv"
    started = time.monotonic()
    _install(name, venv, project_wheel)
    installed_s = time.monotonic() - started
    work = tmp_path / "work"  # an empty working directory: nothing importable from the checkout
    work.mkdir()
    present = json.loads(
        _run(venv, ["python", "-c", PROBE, json.dumps(role.modules), json.dumps(GATEWAY_NEVER)], work).splitlines()[-1]
    )
    assert "Usage" in _run(venv, ["hourglass", "--help"], work)
    for command in role.commands:
        assert "Usage" in _run(venv, ["hourglass", *command, "--help"], work), command
    if name == "gateway":
        assert present == [], f"the gateway's venv holds {present}"
    site = next((venv / "lib").glob("python3*/site-packages"))
    print(f"\nrole {name}: site-packages {_size_mb(site)} MiB, installed in {installed_s:.0f} s")
