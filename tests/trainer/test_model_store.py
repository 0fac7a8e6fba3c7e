"""Model materialisation: verified folders, corruption detected and rebuilt."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trainer.model import store as model_store
from trainer.errors import ModelStoreError, UnknownModelError


def test_materialised_smollm2_verifies_and_greedy_sample_is_recorded(smollm2_model: Path) -> None:
    info = model_store.verify(smollm2_model)
    assert len(info.fingerprint) == 64
    assert "5" in info.greedy_sample  # "What is 2 + 3?" answered greedily
    assert (smollm2_model / "model.safetensors").is_file()
    assert not list(smollm2_model.glob("*.bin")) and not list(smollm2_model.glob("*.gguf"))


def test_corrupted_file_is_detected(tiny_model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(tiny_model, copy)
    assert model_store.verify(copy).fingerprint == model_store.verify(tiny_model).fingerprint
    with (copy / "model.safetensors").open("r+b") as handle:
        handle.seek(200)
        handle.write(b"\x00\x01\x02\x03")
    with pytest.raises(ModelStoreError, match="model.safetensors"):
        model_store.verify(copy)


def test_folder_without_manifest_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(tiny_model, copy)
    (copy / model_store.MANIFEST).unlink()
    with pytest.raises(ModelStoreError, match="partial"):
        model_store.verify(copy)


def test_unknown_model_and_unmaterialised_key(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError):
        model_store.pull("no-such-model", tmp_path)
    with pytest.raises(UnknownModelError):
        model_store.resolve("no-such-model", tmp_path)
    with pytest.raises(ModelStoreError, match="hourglass models pull"):
        model_store.resolve("smollm2-135m-instruct", tmp_path)


@pytest.mark.integration
def test_partial_folder_is_rebuilt_by_pull(smollm2_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    partial = cache / "smollm2-135m-instruct"
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")  # an interrupted earlier pull
    info = model_store.pull("smollm2-135m-instruct", cache)
    assert '"model_type"' in (partial / "config.json").read_text()  # the bogus config was replaced
    assert info.fingerprint == model_store.verify(smollm2_model).fingerprint  # deterministic conversion
    assert model_store.verify(partial).fingerprint == info.fingerprint
    assert not [p for p in cache.iterdir() if "partial" in p.name]  # no staging debris
