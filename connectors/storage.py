"""Durable file writes through ``pyarrow.fs``, so local folders and object stores share one code path.

Local files: written to a temporary name, fsynced, renamed, and the folder
fsynced (POSIX durable-rename idiom; :mod:`connectors.atomic`). Object stores: a single PUT is atomic
and durable on success, so the file is written under its final name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from connectors import atomic
from connectors.errors import BufferStorageError


@dataclass(frozen=True)
class Location:
    """A filesystem and the base path inside it."""

    fs: pafs.FileSystem
    base: str

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.base.rstrip("/"), *parts])


def open_location(uri: str) -> Location:
    """``FileSystem.from_uri`` for a URI (``s3://``, ``gs://``, ``file://``) or a local path.

    Relative local paths are taken relative to the current directory.

    Raises:
        BufferStorageError: the URI names no filesystem pyarrow can open.
    """
    if "://" not in uri:
        uri = Path(os.path.expanduser(uri)).resolve().as_uri()
    try:
        fs, base = pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as err:  # pyarrow.ArrowInvalid is a ValueError
        raise BufferStorageError(
            f"cannot open storage {uri!r}: {err}; use a local path or an s3:// / gs:// URI"
        ) from err
    return Location(fs, base)


def write_durable(loc: Location, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that after return it survives a crash or power loss: one PUT on an
    object store; a local file through :func:`connectors.atomic.write_bytes` (temp name, fsync, rename,
    folder fsync; a write that fails, e.g. on a full disk, removes its own temporary file).

    Raises:
        BufferStorageError: the write, fsync or rename failed.
    """
    try:
        if loc.is_local:
            atomic.write_bytes(path, data)
            return
        loc.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with loc.fs.open_output_stream(path) as out:
            out.write(data)
    except OSError as err:
        raise BufferStorageError(f"could not write {path!r} durably: {err}; check free space and permissions") from err


def read_bytes(loc: Location, path: str) -> bytes:
    """The whole file at ``path``."""
    with loc.fs.open_input_file(path) as f:
        return f.read()


def list_files(loc: Location, under: str, suffix: str) -> list[pafs.FileInfo]:
    """Files below ``under`` whose name ends with ``suffix`` (temporary files excluded), sorted by path."""
    info = loc.fs.get_file_info(under)
    if info.type == pafs.FileType.NotFound:
        return []
    selector = pafs.FileSelector(under, recursive=True, allow_not_found=True)
    files = [
        f
        for f in loc.fs.get_file_info(selector)
        if f.type == pafs.FileType.File and f.base_name.endswith(suffix) and not f.base_name.startswith(".tmp-")
    ]
    return sorted(files, key=lambda f: f.path)
