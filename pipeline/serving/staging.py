"""Stage a registered adapter version on local disk and prove it is safe to load.

Before anything is downloaded, the version's ``hourglass.signature`` must
verify with the service's signing key (:mod:`pipeline.registry.signing`: it covers the
model name, round, candidate, base fingerprint and checksums), and the artifact
sizes MLflow lists must fit ``serving.max_adapter_bytes`` (each file and the
total) in a flat folder. A version is then downloaded file by file (the cap
is checked on disk after each file) into
``<staging_dir>/<model>/v<version>/`` (through a temporary sibling folder
renamed into place), and checked:

1. every path stays inside the staging folder: no symlinks, no ``..``, no
   absolute names, nothing that resolves elsewhere;
2. weights are safetensors only: ``.bin`` / ``.pt`` / ``.pkl`` / ``.pth``
   files (Python pickles, which run code when loaded) are refused;
3. each file's sha256 matches the version's ``hourglass.sha256`` tag, and no
   listed file is missing;
4. the version's ``hourglass.base_fingerprint`` tag equals the served base's
   fingerprint (an adapter trained on another base would load and produce
   garbage);
5. the sizes on disk fit ``serving.max_adapter_bytes`` (a server may lie in its listing);
6. ``adapter_config.json`` is a plain LoRA (:func:`check_adapter_config`):
   ``peft_type`` LORA, ``r`` a positive int at most the server's
   ``--max-lora-rank``, ``lora_alpha`` a positive number, ``use_rslora`` a
   bool, no DoRA, no ``modules_to_save``, ``bias`` "none", and
   ``target_modules`` a non-empty list of module names the base model has
   (:func:`base_module_names`).

Every refusal raises :class:`StagingError` (a ``ValueError``) whose message
says which check failed, with which value, and what to do.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import mlflow
from mlflow.tracking import MlflowClient

from connectors import atomic
from pipeline.errors import PipelineError
from pipeline.registry.client import TAG_FINGERPRINT, TAG_SHA256
from pipeline.registry.signing import SignatureError, verify
from trainer.model.store import sha256_file

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
                raise StagingError(
                    f"unsafe path {entry}: symlinks are refused in staged adapters; re-upload real files"
                )
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


def base_module_names(model_dir: str | Path) -> frozenset[str]:
    """Names LoRA may target in a base model: every module holding a 2-D ``.weight``.

    Read from the safetensors headers of ``model_dir`` (one file or shards; no
    tensor is loaded). Both the leaf names (``q_proj``) and the full module
    paths (``model.layers.0.self_attn.q_proj``) are returned.
    """
    from safetensors import safe_open

    names: set[str] = set()
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), framework="numpy") as handle:
            for key in handle.keys():
                if key.endswith(".weight") and len(handle.get_slice(key).get_shape()) == 2:
                    module = key.removesuffix(".weight")
                    names.add(module)
                    names.add(module.rsplit(".", 1)[-1])
    return frozenset(names)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_adapter_config(config: object, *, max_lora_rank: int, base_modules: frozenset[str] | None) -> int:
    """Validate a parsed ``adapter_config.json`` (peft ``LoraConfig``); returns the rank ``r``.

    ``base_modules``: :func:`base_module_names` of the served base; None skips
    the name check (the list must still be non-empty strings).

    Raises:
        StagingError: the first field that is wrong, with its value.
    """
    if not isinstance(config, dict):
        raise StagingError(f"adapter_config.json must be a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise StagingError(
            f"adapter_config.json peft_type={config.get('peft_type')!r}: only plain LoRA adapters ('LORA') are served"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise StagingError(f"adapter_config.json r={rank!r}: the LoRA rank must be a positive integer")
    if rank > max_lora_rank:
        raise StagingError(
            f"LoRA rank r={rank} exceeds the server's --max-lora-rank={max_lora_rank}; "
            "train with a smaller rank or raise serving.max_lora_rank"
        )
    for name in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(name) or {}
        if not isinstance(pattern, dict) or not all(_is_number(v) and v > 0 for v in pattern.values()):
            raise StagingError(f"adapter_config.json {name}={pattern!r}: must map module names to positive numbers")
        if name == "rank_pattern" and any(v > max_lora_rank or v != int(v) for v in pattern.values()):
            raise StagingError(
                f"adapter_config.json rank_pattern={pattern!r}: ranks must be integers <= {max_lora_rank}"
            )
    alpha = config.get("lora_alpha")
    if not _is_number(alpha) or alpha <= 0:
        raise StagingError(f"adapter_config.json lora_alpha={alpha!r}: must be a positive number")
    if not isinstance(config.get("use_rslora", False), bool):
        raise StagingError(f"adapter_config.json use_rslora={config.get('use_rslora')!r}: must be true or false")
    if config.get("use_dora", False) is not False:
        raise StagingError(f"adapter_config.json use_dora={config.get('use_dora')!r}: DoRA adapters are not served")
    if config.get("modules_to_save") not in (None, []):
        raise StagingError(
            f"adapter_config.json modules_to_save={config.get('modules_to_save')!r}: full copies of base modules are not served"
        )
    if config.get("bias", "none") != "none":
        raise StagingError(f"adapter_config.json bias={config.get('bias')!r}: only bias='none' adapters are served")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(m, str) and m for m in targets):
        raise StagingError(
            f"adapter_config.json target_modules={targets!r}: must be a non-empty list of module names (regex strings are refused)"
        )
    if base_modules is not None:
        unknown = sorted(m for m in targets if m not in base_modules)
        if unknown:
            raise StagingError(f"adapter_config.json target_modules {unknown} are not modules of the served base model")
    return rank


def _check_sizes(folder: Path, max_bytes: int) -> None:
    sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    _check_listed(folder.name, sizes, max_bytes)


def _check_listed(what: str, sizes: Mapping[str, int | None], max_bytes: int) -> None:
    for name, size in sizes.items():
        if size is not None and size > max_bytes:  # None: not listed by the store; checked on disk
            raise StagingError(
                f"{what}: artifact {name!r} is {size} bytes, over serving.max_adapter_bytes={max_bytes}; "
                "a LoRA adapter is far smaller (raise the cap only for a known large adapter)"
            )
    total = sum(s or 0 for s in sizes.values())
    if total > max_bytes:
        raise StagingError(f"{what}: the artifacts total {total} bytes, over serving.max_adapter_bytes={max_bytes}")


def verify_folder(
    root: Path,
    folder: Path,
    checksums: dict[str, str],
    *,
    expected_fingerprint: str,
    fingerprint: str | None,
    max_lora_rank: int,
    max_adapter_bytes: int = 512 * 1024**2,
    base_modules: frozenset[str] | None = None,
) -> int:
    """Run checks 1–6 on a downloaded adapter folder; returns its LoRA rank.

    Raises:
        StagingError: the first check that fails.
    """
    check_inside(root, folder)
    _check_sizes(folder, max_adapter_bytes)
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
    except (OSError, ValueError) as err:
        raise StagingError(f"{folder.name}: adapter_config.json is missing or not JSON: {err}") from err
    try:
        return check_adapter_config(config, max_lora_rank=max_lora_rank, base_modules=base_modules)
    except StagingError as err:
        raise StagingError(f"{folder.name}: {err}") from err


def stage_options(cfg) -> dict:
    """The keyword arguments of :func:`stage_version` that come from the config (``cfg``: HourglassConfig)."""
    from pipeline.registry.signing import signing_keys

    return {
        "max_lora_rank": cfg.serving.max_lora_rank,
        "tracking_uri": cfg.registry.tracking_uri,
        "signing_keys": signing_keys(cfg),
        "max_adapter_bytes": cfg.serving.max_adapter_bytes,
    }


def stage_version(
    client: MlflowClient,
    model: str,
    version: str,
    staging_dir: Path,
    *,
    base_fingerprint: str,
    max_lora_rank: int,
    tracking_uri: str,
    signing_keys: list[bytes],
    max_adapter_bytes: int = 512 * 1024**2,
    base_modules: frozenset[str] | None = None,
    model_version=None,
) -> StagedAdapter:
    """Verify the signature, then download and verify a model version (idempotent: a verified folder is reused).

    ``signing_keys``: :func:`pipeline.registry.signing.signing_keys` (the first signs,
    all are accepted). ``model_version``: the ``ModelVersion`` entity when the
    caller already fetched it (saves a registry round trip).

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
        verify(signing_keys, model, dict(mv.tags))
    except SignatureError as err:
        raise StagingError(f"{model} v{version}: signature refused: {err}") from err
    try:
        checksums = json.loads(mv.tags.get(TAG_SHA256, "{}"))
    except ValueError as err:
        raise StagingError(f"{model} v{version}: the {TAG_SHA256} tag is not JSON: {err}") from err
    if not isinstance(checksums, dict):
        raise StagingError(f"{model} v{version}: the {TAG_SHA256} tag must be a JSON object of file -> sha256")
    kwargs: dict[str, Any] = dict(
        expected_fingerprint=base_fingerprint,
        fingerprint=mv.tags.get(TAG_FINGERPRINT),
        max_lora_rank=max_lora_rank,
        max_adapter_bytes=max_adapter_bytes,
        base_modules=base_modules,
    )
    if target.is_dir():
        try:
            rank = verify_folder(root, target, checksums, **kwargs)
            return StagedAdapter(model, version, target, rank, served_name(model, version))
        except StagingError:
            pass  # download it again, then judge; the new copy replaces it in one step
    uri = client.get_model_version_download_uri(model, version)
    listed = mlflow.artifacts.list_artifacts(artifact_uri=uri, tracking_uri=tracking_uri)
    nested = sorted(f.path for f in listed if f.is_dir)
    if nested:
        raise StagingError(
            f"{model} v{version}: the adapter artifact has sub-folders {nested}; adapters are flat folders"
        )
    _check_listed(f"{model} v{version}", {Path(f.path).name: f.file_size for f in listed}, max_adapter_bytes)
    with atomic.new_dir(target) as local:  # only a verified folder takes the target's place, in one step
        for info in listed:  # file by file: the size cap also holds against a store that lies in its listing
            name = Path(info.path).name
            _safe_name(root, local, name)
            mlflow.artifacts.download_artifacts(
                artifact_uri=f"{uri.rstrip('/')}/{name}", dst_path=str(local), tracking_uri=tracking_uri
            )
            check_inside(root, local)
            _check_sizes(local, max_adapter_bytes)
        rank = verify_folder(root, local, checksums, **kwargs)
    return StagedAdapter(model, version, target, rank, served_name(model, version))
