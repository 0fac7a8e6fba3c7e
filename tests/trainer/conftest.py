"""Fixtures of the trainer tests: small thread counts and a 'peaked' tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# 2 threads by default; HOURGLASS_TEST_THREADS=1 re-runs the float32 equality tests with other reduction
# splits (docs/testing.md, "Equality tests on other CPUs"). The Ray tests set their own (1, as each actor).
torch.set_num_threads(int(os.environ.get("HOURGLASS_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def peaked_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with its final RMSNorm gain raised to 10.

    A random model's next-token distribution is nearly uniform over 49k
    tokens, so no reward has signal. Scaling the final norm sharpens it (like
    a trained LM, a few tokens carry real probability) while staying random.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("peaked") / "model"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.fill_(10.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out
