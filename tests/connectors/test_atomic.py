"""The one atomic writer (connectors/atomic.py): a reader, or the next start after a crash, sees the old
file or folder or the new one, never a part of either, and a failed write leaves nothing behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from connectors import atomic


def test_a_file_is_replaced_whole_with_its_mode_set_before_it_appears(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "secret"
    atomic.write_text(path, "one")
    atomic.write_text(path, "two", mode=0o600)
    assert path.read_text() == "two" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["secret"]  # no temporary file left


def test_a_failed_file_write_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "routes.json"
    atomic.write_text(path, "old")

    def full(path: Path, directory: bool = False) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "_fsync", full)
    with pytest.raises(OSError, match="No space left"):
        atomic.write_text(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["routes.json"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_a_folder_is_replaced_in_one_step_and_an_error_leaves_it_as_it_was(
    tmp_path: Path, monkeypatch, exchange: bool
) -> None:
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # another OS or a file system without it
    target = tmp_path / "adapter"
    with atomic.new_dir(target) as built:
        (built / "weights").write_text("v1")
    with atomic.new_dir(target) as built:
        (built / "weights").write_text("v2")
        (built / "extra").write_text("x")
        assert (target / "weights").read_text() == "v1"  # readers see the old folder while the new one is built
    assert sorted(p.name for p in target.iterdir()) == ["extra", "weights"] and (target / "weights").read_text() == "v2"
    with pytest.raises(RuntimeError, match="download failed"):
        with atomic.new_dir(target) as built:
            (built / "weights").write_text("half")
            raise RuntimeError("download failed")
    assert (target / "weights").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]  # no partial or old folder left


def test_the_fallback_puts_the_old_folder_back_when_the_second_rename_fails(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    target = tmp_path / "staged"
    atomic.copy_dir(_folder(tmp_path / "v1", "v1"), target)
    real_replace = os.replace
    calls = []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "I/O error")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", second_fails)
    with pytest.raises(OSError, match="I/O error"):
        atomic.copy_dir(_folder(tmp_path / "v2", "v2"), target)
    monkeypatch.setattr(atomic.os, "replace", real_replace)
    assert (target / "weights").read_text() == "v1"


def test_copy_dir_replaces_a_kept_copy(tmp_path: Path) -> None:
    last = tmp_path / "last" / "cand"
    atomic.copy_dir(_folder(tmp_path / "a", "a"), last)
    (last / "stale").write_text("from an older round")
    atomic.copy_dir(_folder(tmp_path / "b", "b"), last)
    assert sorted(p.name for p in last.iterdir()) == ["weights"] and (last / "weights").read_text() == "b"


def _folder(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "weights").write_text(content)
    return path
