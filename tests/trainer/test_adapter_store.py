"""Swap correctness: interleaving candidates in one store must give exactly
what training each alone gives (weights, AdamW moments, step counts)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import safetensors.torch
import torch

from trainer.adapter_store import make_store
from trainer.base import load_base
from trainer.config import CandidateConfig, ModelConfig
from trainer.errors import AdapterStoreError

A = CandidateConfig(name="a", lora_rank=4, learning_rate=1e-2)
B = CandidateConfig(name="b", lora_rank=8, learning_rate=5e-3, target_modules=["q_proj", "v_proj"])
C = CandidateConfig(name="c", lora_rank=4, learning_rate=2e-2)


def _batch(name: str, step: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    prompts = torch.randint(10, 1000, (2, 6), generator=g).tolist()
    completions = torch.randint(10, 1000, (2, 5), generator=g).tolist()
    return prompts, completions


def _backward(base, name: str, step: int) -> None:
    prompts, completions = _batch(name, step)
    logprobs_BT, mask_BT = base.completion_logprobs(prompts, completions)
    (-(logprobs_BT * mask_BT).sum() / mask_BT.sum()).backward()


def _train(base, store, name: str, step: int, *, accumulate: int = 1) -> None:
    optimizer = store.activate(name)
    for micro in range(accumulate):
        _backward(base, name, step * 10 + micro)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _assert_same(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> None:
    assert set(x) == set(y)
    assert any(k.startswith("exp_avg/") for k in x), "no optimizer state was compared"
    for key in x:
        torch.testing.assert_close(x[key].float(), y[key].float(), rtol=1e-5, atol=1e-7, msg=key)


@pytest.fixture()
def fresh_base(tiny_model: Path):
    return lambda: load_base(ModelConfig(name=str(tiny_model)))


@pytest.mark.parametrize("kind", ["offload", "resident"])
def test_interleaved_equals_alone_with_delete_and_create(fresh_base, kind: str) -> None:
    alone = {}
    for cand, steps in ((A, 3), (B, 1), (C, 2)):
        base = fresh_base()
        store = make_store(kind, base)
        store.create(cand.name, cand)
        for s in range(steps):
            _train(base, store, cand.name, s)
        alone[cand.name] = store.snapshot(cand.name)

    base = fresh_base()
    store = make_store(kind, base)
    store.create("a", A)
    store.create("b", B)
    _train(base, store, "a", 0)
    _train(base, store, "b", 0)
    b_after_one = store.snapshot("b")
    store.delete("b")
    store.create("c", C)
    _train(base, store, "a", 1)
    _train(base, store, "c", 0)
    _train(base, store, "a", 2)
    _train(base, store, "c", 1)

    _assert_same(store.snapshot("a"), alone["a"])
    _assert_same(b_after_one, alone["b"])
    _assert_same(store.snapshot("c"), alone["c"])
    steps = {k: float(v) for k, v in store.snapshot("a").items() if k.startswith("step/")}
    assert set(steps.values()) == {3.0}
    with pytest.raises(AdapterStoreError, match="unknown candidate 'b'"):
        store.activate("b")


def test_accumulated_gradients_travel_with_their_candidate(fresh_base) -> None:
    base = fresh_base()
    store = make_store("offload", base)
    store.create("a", A)
    optimizer = store.activate("a")
    _backward(base, "a", 0)
    _backward(base, "a", 1)
    optimizer.step()
    alone = store.snapshot("a")

    base = fresh_base()
    store = make_store("offload", base)
    store.create("a", A)
    store.create("c", C)
    store.activate("a")
    _backward(base, "a", 0)  # gradient waits in host memory while c trains
    _train(base, store, "c", 0)
    optimizer = store.activate("a")
    _backward(base, "a", 1)
    optimizer.step()
    _assert_same(store.snapshot("a"), alone)


def test_saved_adapter_is_a_peft_folder_that_restarts_training(fresh_base, tmp_path: Path) -> None:
    base = fresh_base()
    store = make_store("offload", base)
    store.create("a", A)
    _train(base, store, "a", 0)
    store.create("b", B)
    store.activate("b")  # a now lives in host memory
    folder = store.save("a", tmp_path / "a")
    assert (folder / "adapter_config.json").is_file()
    saved = safetensors.torch.load_file(str(folder / "adapter_model.safetensors"))
    weights = {k.removeprefix("weight/"): v for k, v in store.snapshot("a").items() if k.startswith("weight/")}
    assert set(saved) == set(weights) and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in saved)
    assert all(torch.equal(saved[k], weights[k]) for k in saved)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k), "lora_B never moved off zero"

    store.create("a2", A, init_dir=folder)
    restored = {k: v for k, v in store.snapshot("a2").items() if k.startswith("weight/")}
    assert all(torch.equal(restored[k], store.snapshot("a")[k]) for k in restored)
    with pytest.raises(ValueError, match="does not fit rank 8"):
        store.create("b2", B, init_dir=folder)
