"""The resident base loads safetensors weights only: a ``model.name`` folder whose weights are pickles
(``pytorch_model.bin``) is refused before transformers reads them (found by a red-team pass: only
``hourglass up`` ran ``models check``; the trainer's ``from_pretrained`` loaded the pickle)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from trainer.config import ModelConfig
from trainer.errors import ModelStoreError
from trainer.model.base import load_base


def test_a_base_folder_of_pickled_weights_is_refused_before_loading(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_model, folder)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")  # the same weights, pickled
    (folder / "model.safetensors").unlink()

    def no_unpickling(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load ran on the base's weights")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(ModelStoreError, match="safetensors"):
        load_base(ModelConfig(name=str(folder), dtype="float32", device="cpu"))
