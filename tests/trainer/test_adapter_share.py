"""The shared adapter store (pure file logic) and the fleet's placement rule (no server needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.adapters.share import MANIFEST, AdapterShareError, evict, fetch, publish, remove
from trainer.errors import RolloutError
from trainer.types import RolloutRequest
from trainer.rollout.fleet import FleetEngine


def _adapter(folder: Path, weights: bytes = b"weights") -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_publish_then_fetch_gives_a_verified_copy_in_the_readers_cache(tmp_path: Path) -> None:
    share, cache = tmp_path / "share", tmp_path / "cache"
    files = publish(_adapter(tmp_path / "a"), str(share), "hg-v3")
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((share / "hg-v3" / MANIFEST).read_text())["files"] == files
    copy = fetch(str(share), "hg-v3", cache)
    assert copy == cache / "hg-v3" and (copy / "adapter_model.safetensors").read_bytes() == b"weights"
    assert fetch(f"file://{share}", "hg-v3", cache) == copy  # a URI works too; a verified copy is reused
    assert fetch(str(share), "never-published", cache) is None
    remove(str(share), "hg-v3")
    assert not (share / "hg-v3").exists()


def test_a_tampered_or_torn_copy_is_refused_and_not_left_in_the_cache(tmp_path: Path) -> None:
    share, cache = tmp_path / "share", tmp_path / "cache"
    publish(_adapter(tmp_path / "a"), str(share), "cand-s1")
    (share / "cand-s1" / "adapter_model.safetensors").write_bytes(b"other weights")
    with pytest.raises(AdapterShareError, match="checksum"):
        fetch(str(share), "cand-s1", cache)
    assert not (cache / "cand-s1").exists() and not [p for p in cache.iterdir() if p.name.startswith(".")]
    (share / "cand-s1" / MANIFEST).write_text("{not json")
    with pytest.raises(AdapterShareError, match="not a valid manifest"):
        fetch(str(share), "cand-s1", cache)
    (share / "cand-s1" / MANIFEST).write_text(json.dumps({"files": {"../../etc/passwd": "0" * 64}}))
    with pytest.raises(AdapterShareError, match="not a plain name"):
        fetch(str(share), "cand-s1", cache)


@pytest.mark.parametrize("name", ["", "../x", "a/b", "..", ".hidden", "a b"])
def test_unsafe_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(AdapterShareError, match="not a plain name"):
        publish(_adapter(tmp_path / "a"), str(tmp_path / "share"), name)


def test_pickle_weights_are_neither_published_nor_fetched(tmp_path: Path) -> None:
    share, cache = tmp_path / "share", tmp_path / "cache"
    folder = _adapter(tmp_path / "a")
    (folder / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(AdapterShareError, match="refusing pickle files"):
        publish(folder, str(share), "hg-v5")
    (folder / "adapter_model.bin").unlink()
    files = publish(folder, str(share), "hg-v5")
    (share / "hg-v5" / "adapter_model.bin").write_bytes(b"pickle")  # a writer that skipped the check
    (share / "hg-v5" / MANIFEST).write_text(json.dumps({"files": {**files, "adapter_model.bin": "0" * 64}}))
    with pytest.raises(AdapterShareError, match=r"refusing pickle files \['adapter_model.bin'\]"):
        fetch(str(share), "hg-v5", cache)  # was downloaded and handed to vLLM, which loads .bin with torch.load
    assert not (cache / "hg-v5").exists()


def test_publish_refuses_a_folder_that_is_not_a_flat_adapter(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterShareError, match="no adapter_config.json"):
        publish(tmp_path / "empty", str(tmp_path / "share"), "x-s0")
    nested = _adapter(tmp_path / "nested")
    (nested / "sub").mkdir()
    with pytest.raises(AdapterShareError, match="not plain files"):
        publish(nested, str(tmp_path / "share"), "x-s0")


def test_evict_keeps_the_newest_folders(tmp_path: Path) -> None:
    import os

    for i in range(4):
        (tmp_path / f"v{i}").mkdir()
        os.utime(tmp_path / f"v{i}", (1000 + i, 1000 + i))
    assert evict(tmp_path, keep=2) == ["v0", "v1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]


def test_fleet_places_candidates_round_robin_and_base_requests_by_prompt() -> None:
    engine = FleetEngine(["http://r0:8000", "http://r1:8000/", "http://r0:8000"])  # duplicates collapse
    assert engine.urls == ["http://r0:8000", "http://r1:8000"]
    assert [engine.replica_of(c) for c in ["a", "b", "c", "a", "champion-0"]] == [0, 1, 0, 0, 1]
    # the base (on every replica) goes by prompt id: the same prompt meets the same prefix cache
    req = RolloutRequest("base", "p7", (1, 2), n=1, max_new_tokens=1)
    assert engine._engine_for(req) == engine._engine_for(RolloutRequest("base", "p7", (3,), n=2, max_new_tokens=1))
    with pytest.raises(RolloutError, match="not loaded"):
        engine._engine_for(RolloutRequest("a-s0", "p1", (1,), n=1, max_new_tokens=1))
    with pytest.raises(RolloutError, match="at least one replica"):
        FleetEngine([])
