"""Stage a registered adapter version on local disk and prove it is safe to load.

A version is downloaded into ``<staging_dir>/<model>/v<version>/`` (through a
temporary sibling folder renamed into place), then checked:

1. every path stays inside the staging folder: no symlinks, no ``..``, no
   absolute names, nothing that resolves elsewhere;
2. weights are safetensors only: ``.bin`` / ``.pt`` / ``.pkl`` / ``.pth``
   files (Python pickles, which run code when loaded) are refused;
3. each file's sha256 matches the version's ``hourglass.sha256`` tag, and no
   listed file is missing;
4. the version's ``hourglass.base_fingerprint`` tag equals the served base's
   fingerprint (an adapter trained on another base would load and produce
   garbage);
5. ``adapter_config.json`` ``r`` is at most the server's ``--max-lora-rank``.

Every refusal raises :class:`StagingError` (a ``ValueError``) whose message
says which check failed, with which value, and what to do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from pipeline.errors import PipelineError
from pipeline.registry import TAG_FINGERPRINT, TAG_SHA256
from trainer.model_store import sha256_file

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_VERSION = re.compile(r"^[0-9]+$")


class StagingError(PipelineError, ValueError):
    """An adapter version failed a staging check and must not be loaded."""


@dataclass(frozen=True)
class StagedAdapter:
    """A verified adapter folder, ready for ``/v1/load_lora_adapter``."""

    model: str
    version: str
    path: Path  # absolute, inside the staging dir
    rank: int
    served_name: str


def served_name(model: str, version: str) -> str:
    """The versioned name vLLM serves a version under: ``<model>-v<version>``."""
    return f"{model}-v{version}"


def check_inside(root: Path, folder: Path) -> None:
    """Refuse any entry of ``folder`` that is a symlink or resolves outside ``root``.

    Raises:
        StagingError: the first unsafe path found.
    """
    root = root.resolve()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        for name in dirnames + filenames:
            entry = Path(dirpath) / name
            if entry.is_symlink():
                raise StagingError(f"unsafe path {entry}: symlinks are refused in staged adapters; re-upload real files")
            if not entry.resolve().is_relative_to(root):
                raise StagingError(f"unsafe path {entry}: resolves outside the staging dir {root}")


def _safe_name(root: Path, folder: Path, name: str) -> Path:
    if not name or "/" in name or "\\" in name or name in (".", "..") or Path(name).is_absolute():
        raise StagingError(
            f"unsafe path {name!r} in the {TAG_SHA256} tag: adapter files must be plain names inside the adapter folder"
        )
    path = (folder / name).resolve()
    if not path.is_relative_to(root.resolve()):
        raise StagingError(f"unsafe path {name!r}: resolves to {path}, outside the staging dir {root}")
    return path


def verify_folder(
    root: Path, folder: Path, checksums: dict[str, str], *, expected_fingerprint: str, fingerprint: str | None,
    max_lora_rank: int,
) -> int:
    """Run checks 1–5 on a downloaded adapter folder; returns its LoRA rank.

    Raises:
        StagingError: the first check that fails.
    """
    check_inside(root, folder)
    if not checksums:
        raise StagingError(f"{folder.name}: the version has no {TAG_SHA256} tag; register it through Hourglass")
    files = {p.name for p in folder.iterdir()}
    pickles = sorted(n for n in files | set(checksums) if n.lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        raise StagingError(
            f"{folder.name}: refusing pickle weights {pickles}: only safetensors are loaded (pickles can run code); "
            "save the adapter with safe_serialization=True"
        )
    if not any(n.endswith(".safetensors") for n in files):
        raise StagingError(f"{folder.name}: no .safetensors weights in {sorted(files)}")
    for name, expected in sorted(checksums.items()):
        path = _safe_name(root, folder, name)
        if not path.is_file():
            raise StagingError(f"{folder.name}: file {name!r} listed in {TAG_SHA256} is missing from the artifacts")
        actual = sha256_file(path)
        if actual != expected:
            raise StagingError(
                f"{folder.name}: checksum mismatch for {name!r}: sha256 {actual[:16]}… but the version says "
                f"{expected[:16]}…; the artifact is corrupted or was changed after registration"
            )
    unlisted = sorted(files - set(checksums))
    if unlisted:
        raise StagingError(f"{folder.name}: files {unlisted} are not covered by the {TAG_SHA256} tag")
    if fingerprint != expected_fingerprint:
        raise StagingError(
            f"{folder.name}: adapter was trained on base {str(fingerprint)[:16]}…, but the server runs base "
            f"{expected_fingerprint[:16]}…; train it on the served base model"
        )
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        rank = int(config["r"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StagingError(f"{folder.name}: adapter_config.json is missing or has no integer 'r': {err}") from err
    if rank > max_lora_rank:
        raise StagingError(
            f"{folder.name}: LoRA rank r={rank} exceeds the server's --max-lora-rank={max_lora_rank}; "
            "train with a smaller rank or raise serving.max_lora_rank"
        )
    return rank


def stage_version(
    client: MlflowClient, model: str, version: str, staging_dir: Path, *, base_fingerprint: str, max_lora_rank: int,
    tracking_uri: str, model_version=None,
) -> StagedAdapter:
    """Download and verify a model version (idempotent: a verified folder is reused).

    ``model_version``: the ``ModelVersion`` entity when the caller already
    fetched it (saves a registry round trip).

    Raises:
        StagingError: a check failed (the folder is removed).
        MlflowException: MLflow could not be reached.
    """
    version = str(version)
    if not _VERSION.match(version):
        raise StagingError(f"version {version!r} is not a registry version number")
    root = Path(staging_dir).resolve()
    target = root / model / f"v{version}"
    if not target.resolve().is_relative_to(root):
        raise StagingError(f"unsafe path {target}: model name {model!r} escapes the staging dir {root}")
    mv = model_version if model_version is not None else client.get_model_version(model, version)
    try:
        checksums = json.loads(mv.tags.get(TAG_SHA256, "{}"))
    except ValueError as err:
        raise StagingError(f"{model} v{version}: the {TAG_SHA256} tag is not JSON: {err}") from err
    if not isinstance(checksums, dict):
        raise StagingError(f"{model} v{version}: the {TAG_SHA256} tag must be a JSON object of file -> sha256")
    kwargs = dict(expected_fingerprint=base_fingerprint, fingerprint=mv.tags.get(TAG_FINGERPRINT), max_lora_rank=max_lora_rank)
    if target.is_dir():
        try:
            rank = verify_folder(root, target, checksums, **kwargs)
            return StagedAdapter(model, version, target, rank, served_name(model, version))
        except StagingError:
            shutil.rmtree(target, ignore_errors=True)  # download it again, then judge
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version}.partial-", dir=target.parent))
    try:
        uri = client.get_model_version_download_uri(model, version)
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp), tracking_uri=tracking_uri))
        check_inside(root, tmp)
        if local != tmp:
            local.rename(tmp / "_adapter")
            local = tmp / "_adapter"
        rank = verify_folder(root, local, checksums, **kwargs)
        if target.exists():
            shutil.rmtree(target)
        os.replace(local, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return StagedAdapter(model, version, target, rank, served_name(model, version))
