"""A shared adapter store: how LoRA folders reach vLLM replicas that do not share a disk with the writer.

The writer (the serving controller for champions, a trainer for its rollout
versions) *publishes* a flat adapter folder under ``<uri>/<name>/`` and writes
``hourglass-manifest.json`` (``{"files": {file name: sha256}}``) last, so a
reader never sees a half-written adapter as complete. The replica side
(:mod:`pipeline.serving.lora_resolver`, a vLLM LoRA resolver plugin) *fetches*
``<uri>/<name>/`` into its own cache folder, checks every file against the
manifest, and hands vLLM the local copy.

``uri``: a local path or any URI ``pyarrow.fs.FileSystem.from_uri`` opens
(``file://``, ``s3://``, ``gs://``). Names are adapter names as vLLM serves them
(``<model>-v<version>``, ``<candidate>-s<step>``): letters, digits, ``.``,
``_`` and ``-`` only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pyarrow.fs as pafs

from connectors import atomic
from trainer.errors import TrainerError

MANIFEST = "hourglass-manifest.json"
# Python pickles run code when loaded: the share carries safetensors weights only (as staging requires).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class AdapterShareError(TrainerError, ValueError):
    """An adapter could not be published to, or fetched from, the shared adapter store."""


def _open(uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in uri:
        uri = Path(os.path.expanduser(uri)).resolve().as_uri()
    try:
        return pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as err:  # pyarrow.ArrowInvalid is a ValueError
        raise AdapterShareError(
            f"cannot open the adapter share {uri!r}: {err}; use a local path or an s3:// / gs:// URI"
        ) from err


def _write(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """One file under its final name (a single PUT on object stores; write + rename locally)."""
    tmp = f"{path.rsplit('/', 1)[0]}/.tmp-{os.getpid()}-{path.rsplit('/', 1)[1]}"
    try:
        with fs.open_output_stream(tmp) as out:
            out.write(data)
        fs.move(tmp, path)
    except OSError as err:
        raise AdapterShareError(
            f"could not write {path!r} to the adapter share: {err}; check access and free space"
        ) from err


def _read(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_file(path) as handle:
        return handle.read()


def check_name(name: str) -> str:
    """``name`` when it is a safe adapter name (one path segment); raises AdapterShareError otherwise."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise AdapterShareError(
            f"adapter name {name!r} is not a plain name (letters, digits, '.', '_', '-', no '..'); it cannot name a shared folder"
        )
    return name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def publish(folder: str | Path, uri: str, name: str) -> dict[str, str]:
    """Copy the flat adapter ``folder`` to ``<uri>/<name>/``, manifest last; returns ``{file: sha256}``.

    Publishing the same name again with the same files is a no-op in effect
    (files are rewritten, the manifest is identical).

    Raises:
        AdapterShareError: a bad name, a nested folder, pickle files (``.bin``, ``.pt``, ...), or no adapter_config.json.
        (also when the store cannot be opened or written).
    """
    check_name(name)
    src = Path(folder)
    entries = sorted(src.iterdir()) if src.is_dir() else []
    if not (src / "adapter_config.json").is_file():
        raise AdapterShareError(
            f"{src} is not an adapter folder (no adapter_config.json); nothing published as {name!r}"
        )
    nested = [p.name for p in entries if not p.is_file() or p.is_symlink()]
    if nested:
        raise AdapterShareError(f"{src}: {nested} are not plain files; adapters are flat folders")
    _refuse_pickles(str(src), [p.name for p in entries])
    fs, base = _open(uri)
    folder_path = f"{base.rstrip('/')}/{name}"
    try:
        fs.create_dir(folder_path, recursive=True)
    except OSError as err:
        raise AdapterShareError(f"cannot create {folder_path!r} in the adapter share {uri!r}: {err}") from err
    files: dict[str, str] = {}
    for path in entries:
        if path.name == MANIFEST:
            continue
        _write(fs, f"{folder_path}/{path.name}", path.read_bytes())
        files[path.name] = _sha256(path)
    _write(fs, f"{folder_path}/{MANIFEST}", json.dumps({"files": files}, sort_keys=True).encode())
    return files


def remove(uri: str, name: str) -> None:
    """Delete ``<uri>/<name>/`` (absent is not an error)."""
    fs, base = _open(uri)
    try:
        fs.delete_dir(f"{base.rstrip('/')}/{check_name(name)}")
    except OSError:
        pass


def fetch(uri: str, name: str, cache_dir: str | Path) -> Path | None:
    """The local copy ``<cache_dir>/<name>/`` of the published adapter ``name``; None when it is not published.

    A verified copy already in the cache is reused. A download goes to a
    temporary sibling, is checked file by file against the manifest (every
    listed file present, sha256 equal, nothing unlisted) and renamed into
    place.

    Raises:
        AdapterShareError: a bad name, an unreadable manifest, a manifest listing pickle files, or a checksum mismatch.
        (also when the store cannot be opened).
    """
    check_name(name)
    fs, base = _open(uri)
    folder_path = f"{base.rstrip('/')}/{name}"
    try:
        manifest = json.loads(_read(fs, f"{folder_path}/{MANIFEST}"))
        files = manifest["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("'files' must be a non-empty object")
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as err:
        raise AdapterShareError(
            f"{uri}/{name}/{MANIFEST} is not a valid manifest: {err}; publish the adapter again"
        ) from err
    for file_name in files:
        check_name(file_name)
    _refuse_pickles(f"{uri}/{name}", list(files))
    cache = Path(cache_dir)
    target = cache / name
    if target.is_dir() and _matches(target, files):
        return target
    with atomic.new_dir(target) as tmp:  # a stale copy is replaced in one step, only by a verified one
        for file_name in files:
            try:
                (tmp / file_name).write_bytes(_read(fs, f"{folder_path}/{file_name}"))
            except OSError as err:
                raise AdapterShareError(
                    f"{uri}/{name}/{file_name} listed in the manifest cannot be read: {err}"
                ) from err
        if not _matches(tmp, files):
            raise AdapterShareError(
                f"{uri}/{name}: the files do not match {MANIFEST} (a checksum differs); the shared copy is corrupted, publish it again"
            )
    return target


def _refuse_pickles(where: str, names: list[str]) -> None:
    pickles = sorted(n for n in names if n.lower().endswith(PICKLE_SUFFIXES))
    if pickles:
        raise AdapterShareError(
            f"{where}: refusing pickle files {pickles}: the adapter share carries safetensors weights only "
            "(pickles can run code when loaded); save the adapter with safe_serialization=True"
        )


def _matches(folder: Path, files: dict[str, str]) -> bool:
    present = {p.name for p in folder.iterdir()}
    return present == set(files) and all(_sha256(folder / n) == digest for n, digest in files.items())


def evict(cache_dir: str | Path, keep: int) -> list[str]:
    """Remove the least recently fetched adapter folders of ``cache_dir`` beyond ``keep``; returns their names."""
    cache = Path(cache_dir)
    if not cache.is_dir():
        return []
    folders = sorted(
        (p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.stat().st_mtime
    )
    gone = folders[: max(0, len(folders) - keep)]
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return [p.name for p in gone]
