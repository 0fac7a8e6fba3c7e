"""The registry's outbox (pipeline/registry/outbox.py): one write-ahead folder per pending registration,
written whole or not at all, kept as is when it exists, listed oldest first, removed once registered."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.registry.outbox import REWARD_MODELS, ROUNDS, Outbox


def _adapter(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_text(content)
    return path


def test_an_entry_is_written_whole_kept_as_is_and_removed_once_registered(tmp_path: Path) -> None:
    cfg = load_config(None).model_copy(update={"state_dir": str(tmp_path / "state")})
    box = Outbox(cfg, ROUNDS)
    entry = box.put("r1", {"round_id": "r1"}, {"adapters/a": _adapter(tmp_path / "a", "v1")})
    assert entry == tmp_path / "state" / "registry" / "pending" / "r1"
    assert (entry / "adapters" / "a" / "adapter_model.safetensors").read_text() == "v1"
    assert box.read("r1") == {"round_id": "r1"} and box.read("r2") is None
    box.put("r1", {"round_id": "changed"}, {"adapters/a": _adapter(tmp_path / "b", "v2")})  # a retry writes nothing
    assert box.read("r1") == {"round_id": "r1"}
    time.sleep(0.01)
    box.put("r0", {"round_id": "r0"})
    os.utime(entry, (time.time() - 60, time.time() - 60))
    assert box.pending() == ["r1", "r0"]  # oldest first
    assert Outbox(cfg, REWARD_MODELS).pending() == []  # the boxes are apart
    box.done("r1")
    assert box.pending() == ["r0"] and not entry.exists()


def test_a_failed_write_leaves_no_entry(tmp_path: Path) -> None:
    cfg = load_config(None).model_copy(update={"state_dir": str(tmp_path / "state")})
    box = Outbox(cfg, REWARD_MODELS)
    with pytest.raises(FileNotFoundError):
        box.put("r1", {"round_id": "r1"}, {"files": tmp_path / "missing"})
    assert box.pending() == [] and list(box.root.iterdir()) == []
