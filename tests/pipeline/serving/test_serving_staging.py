"""Unit tests of the staging checks and the routes file (pure logic, no services)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from connectors.gateway.routes import Route, read_routes, write_route
from pipeline.serving.staging import StagingError, check_inside, verify_folder
from trainer.model.store import sha256_file

FP = "a" * 64


def _adapter(folder: Path, rank: int = 8, weights: str = "adapter_model.safetensors") -> dict[str, str]:
    folder.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 16,
        "use_rslora": False,
        "use_dora": False,
        "target_modules": ["q_proj", "v_proj"],
        "modules_to_save": None,
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / weights).write_bytes(b"weights")
    return {p.name: sha256_file(p) for p in folder.iterdir()}


def _verify(root: Path, folder: Path, sums: dict[str, str], fingerprint: str = FP, max_rank: int = 16) -> int:
    return verify_folder(root, folder, sums, expected_fingerprint=FP, fingerprint=fingerprint, max_lora_rank=max_rank)


def test_good_adapter_passes_and_reports_rank(tmp_path):
    sums = _adapter(tmp_path / "m" / "v1", rank=8)
    assert _verify(tmp_path, tmp_path / "m" / "v1", sums) == 8


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda folder, sums: (folder / "adapter_model.safetensors").write_bytes(b"changed"), "checksum mismatch"),
        (lambda folder, sums: sums.__setitem__("../../etc/passwd", "0" * 64), "unsafe path"),
        (lambda folder, sums: sums.__setitem__("/etc/passwd", "0" * 64), "unsafe path"),
        (lambda folder, sums: (folder / "extra.txt").write_text("x"), "not covered"),
        (lambda folder, sums: sums.__setitem__("gone.json", "0" * 64), "is missing"),
        (lambda folder, sums: os.symlink("/etc/hostname", folder / "link.json"), "symlinks are refused"),
        (lambda folder, sums: sums.clear(), "no hourglass.sha256 tag"),
    ],
    ids=["checksum", "dotdot", "absolute", "unlisted", "missing", "symlink", "no-checksums"],
)
def test_tampered_folder_is_refused(tmp_path, mutate, message):
    folder = tmp_path / "m" / "v1"
    sums = _adapter(folder)
    mutate(folder, sums)
    with pytest.raises(StagingError, match=message):
        _verify(tmp_path, folder, sums)


def test_pickle_weights_are_refused(tmp_path):
    sums = _adapter(tmp_path / "v1", weights="adapter_model.bin")
    with pytest.raises(StagingError, match=r"refusing pickle weights \['adapter_model.bin'\]"):
        _verify(tmp_path, tmp_path / "v1", sums)


def test_rank_and_fingerprint_are_checked(tmp_path):
    sums = _adapter(tmp_path / "v1", rank=32)
    with pytest.raises(StagingError, match="r=32 exceeds the server's --max-lora-rank=16"):
        _verify(tmp_path, tmp_path / "v1", sums)
    assert _verify(tmp_path, tmp_path / "v1", sums, max_rank=32) == 32
    with pytest.raises(StagingError, match="trained on base bbbbbbbbbbbbbbbb"):
        _verify(tmp_path, tmp_path / "v1", sums, fingerprint="b" * 64, max_rank=32)


def test_folder_linked_from_outside_is_refused(tmp_path):
    outside = tmp_path / "outside"
    _adapter(outside)
    root = tmp_path / "staging"
    root.mkdir()
    os.symlink(outside, root / "v1")
    with pytest.raises(StagingError, match="symlinks are refused"):
        check_inside(root, root)


def test_routes_file_round_trip_and_atomic_update(tmp_path):
    assert read_routes(tmp_path) == {}
    write_route(tmp_path, "a", Route("a-v1", "1", "2026-01-01T00:00:00+00:00"))
    write_route(tmp_path, "b", Route("b-v3", "3", "2026-01-01T00:00:01+00:00"))
    write_route(tmp_path, "a", Route("a-v2", "2", "2026-01-01T00:00:02+00:00"))
    routes = read_routes(tmp_path)
    assert {k: (r.served_name, r.version) for k, r in routes.items()} == {"a": ("a-v2", "2"), "b": ("b-v3", "3")}
    assert json.loads((tmp_path / "routes.json").read_text())["a"]["served_name"] == "a-v2"
    assert [p.name for p in tmp_path.iterdir()] == ["routes.json"]  # no temp files left behind
