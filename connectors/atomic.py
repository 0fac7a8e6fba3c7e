"""Writing a local file or folder so that a reader, or the next start after a crash, sees the old one or
the new one, never a part of either: the one writer every package uses (it lives in the lowest package
so that ``connectors``, ``trainer`` and ``pipeline`` may all import it).

- :func:`write_bytes` / :func:`write_text`: a temporary file in the same folder (``.tmp-<random>``,
  the prefix the buffer's sweep of stale temporaries knows), fsynced, renamed over the target, and
  the folder fsynced so that the rename itself survives a power loss (the POSIX durable-rename idiom);
  an optional file mode is set before the rename (a secret is never readable by others, not even
  for an instant).
- :func:`new_dir`: a folder built in a temporary sibling; on success it takes the target's place in
  one step (a rename when there is no target; an atomic exchange, Linux ``renameat2(RENAME_EXCHANGE)``,
  then the old folder is removed, when there is one); on an error the partial folder is removed and
  the target is untouched. Where the exchange is not available (another OS, a file system that refuses
  it) the old folder is renamed aside first, so a crash between the two renames leaves no target (a
  reader then finds it missing, the state every caller already handles: fetch, stage or copy again),
  never a mixed one.
- :func:`copy_dir`: a folder's copy, through :func:`new_dir`.

Object stores (``pyarrow.fs`` URIs) need none of this: a single PUT is atomic there (see
:mod:`connectors.storage`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

TMP_PREFIX = ".tmp-"
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _default_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file: 0666 less the umask (read without changing it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


def write_bytes(path: str | Path, data: bytes, *, mode: int | None = None) -> Path:
    """Put ``data`` at ``path`` durably and atomically (see the module docstring); the folder is created.
    ``mode``: the file's permissions (default: those of a plainly created file, 0666 less the umask).

    Raises:
        OSError: the write, fsync or rename failed (the temporary file is removed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        _fsync(Path(tmp))  # fsync on a second descriptor flushes the inode's dirty pages
        os.chmod(tmp, _default_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync(path.parent, directory=True)
    return path


def write_text(path: str | Path, text: str, *, mode: int | None = None) -> Path:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    return write_bytes(path, text.encode("utf-8"), mode=mode)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not on this kernel or file system
        return False
    raise OSError(errno, os.strerror(errno), str(b))


def _replace_dir(built: Path, target: Path) -> None:
    """``built`` takes ``target``'s place (see the module docstring); the old folder is removed."""
    if not target.exists():
        os.replace(built, target)
    elif _exchange(built, target):
        shutil.rmtree(built, ignore_errors=True)  # ``built`` now names the old folder
    else:
        aside = target.with_name(f"{TMP_PREFIX}{target.name}-old-{uuid.uuid4().hex[:8]}")
        os.replace(target, aside)
        try:
            os.replace(built, target)
        except BaseException:
            os.replace(aside, target)  # the old folder goes back: the target never stays missing after an error
            raise
        shutil.rmtree(aside, ignore_errors=True)
    _fsync(target.parent, directory=True)


@contextlib.contextmanager
def new_dir(target: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``target``; fill it, and on leaving the block it replaces
    ``target`` atomically (see the module docstring). An error inside the block removes it and leaves
    ``target`` as it was.

    Raises:
        OSError: the folder could not be created or renamed.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))
    try:
        yield built
        _replace_dir(built, target)
    finally:
        shutil.rmtree(built, ignore_errors=True)  # gone already after a rename; a leftover after an error


def copy_dir(source: str | Path, target: str | Path) -> Path:
    """A copy of the folder ``source`` at ``target``, replacing what was there atomically (symlinks are
    copied as the files they point to). Returns ``target``."""
    with new_dir(target) as built:
        shutil.copytree(source, built, dirs_exist_ok=True, symlinks=False)
    return Path(target)
