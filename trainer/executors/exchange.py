"""Where a distributed round's files travel: :class:`Exchange`, folders and small JSON files under
``<uri>/<round_id>/`` on any ``pyarrow.fs`` filesystem, and each party's local scratch folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow.fs as pafs

from trainer.errors import TrainerConfigError


class Exchange:
    """Folders and small JSON files under ``<uri>/<round_id>/`` on any ``pyarrow.fs`` filesystem.

    ``uri``: ``s3://bucket/prefix``, ``gs://...``, ``hdfs://...``, ``file:///abs/path`` or an
    absolute local path. Every party (the round driver, each trainer actor) opens it by
    URI, so nobody assumes a shared local disk. Raises ``pyarrow`` ``OSError`` subclasses
    on I/O failure; :class:`TrainerConfigError` for a URI ``pyarrow.fs`` cannot open.
    """

    def __init__(self, uri: str, round_id: str) -> None:
        self.uri = uri
        try:
            self.fs, root = pafs.FileSystem.from_uri(uri)
        except ValueError as err:  # pyarrow.ArrowInvalid
            raise TrainerConfigError(
                f"rl.ray.storage_uri {uri!r} is not a pyarrow.fs URI ({err}); use s3://..., gs://... or file:///abs/path"
            ) from err
        self.root = f"{root.rstrip('/')}/{round_id}"

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def put_dir(self, local: Path, *parts: str) -> None:
        """Copy a local folder to ``<root>/<parts>``."""
        dest = self.path(*parts)
        self.fs.create_dir(dest, recursive=True)
        pafs.copy_files(
            str(Path(local).resolve()), dest, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs
        )

    def get_dir(self, local: Path, *parts: str) -> Path:
        """Copy ``<root>/<parts>`` into the local folder ``local`` (created); returns ``local``."""
        Path(local).mkdir(parents=True, exist_ok=True)
        pafs.copy_files(
            self.path(*parts),
            str(Path(local).resolve()),
            source_filesystem=self.fs,
            destination_filesystem=pafs.LocalFileSystem(),
        )
        return Path(local)

    def put_text(self, text: str, *parts: str) -> None:
        dest = self.path(*parts)
        self.fs.create_dir(dest.rsplit("/", 1)[0], recursive=True)
        with self.fs.open_output_stream(dest) as out:
            out.write(text.encode())

    def get_text(self, *parts: str) -> str:
        with self.fs.open_input_stream(self.path(*parts)) as src:
            return src.read().decode()

    def remove(self) -> None:
        """Delete ``<root>`` (missing is fine)."""
        try:
            self.fs.delete_dir(self.root)
        except FileNotFoundError:
            pass


def local_scratch(prefix: str) -> Path:
    """A fresh local folder for one party's working files (deleted by its owner)."""
    return Path(tempfile.mkdtemp(prefix=prefix))
