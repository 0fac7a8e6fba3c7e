"""Swap correctness: interleaving candidates in one store must give exactly
what training each alone gives (weights, AdamW moments, step counts)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import safetensors.torch
import torch

from trainer.adapters.store import make_store
from trainer.adapters.lora_tensors import ADAPTER_WEIGHTS
from trainer.model.base import load_base
from trainer.config import CandidateConfig, ModelConfig
from trainer.errors import AdapterStoreError, TrainerConfigError

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
    if torch.cuda.is_available():  # the base is on the GPU (bench/device_check.sh): see below
        for key in x:
            torch.testing.assert_close(x[key].float(), y[key].float(), rtol=1e-5, atol=1e-7, msg=key)
        return
    # Exact on a CPU: a candidate's steps run the same batches through the same base with its own weights,
    # whichever candidates share the store, so the same kernels sum in the same order, bit for bit. A tolerance
    # would not do: AdamW turns any rounding difference into up to ~lr on near-zero-gradient elements. On CUDA
    # some backward kernels accumulate with atomics (not bit-reproducible run to run), so the GPU check keeps the
    # tolerance it passed with on the H200 (docs/testing.md, "The GPU check").
    differ = [key for key in x if not torch.equal(x[key], y[key])]
    assert not differ, {key: float((x[key].float() - y[key].float()).abs().max()) for key in differ}


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
    with pytest.raises(ValueError, match="adapts modules the candidate does not target"):
        store.create("b2", B, init_dir=folder)  # a adapts k_proj/o_proj, b only q/v


@pytest.mark.parametrize("kind", ["offload", "resident"])
def test_start_adapter_of_another_base_is_refused_at_create(fresh_base, tmp_path: Path, kind: str) -> None:
    base = fresh_base()
    store = make_store(kind, base)
    store.create("a", A)
    folder = store.save("a", tmp_path / "a")
    tensors = safetensors.torch.load_file(str(folder / ADAPTER_WEIGHTS))
    key = next(k for k in sorted(tensors) if ".lora_A." in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] * 2)  # another base's hidden size
    safetensors.torch.save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    with pytest.raises(TrainerConfigError, match="not trained on this base model"):
        store.create("b", A, init_dir=folder)
    assert store.names() == ["a"]


def test_a_swap_that_fails_half_way_loses_nobody(fresh_base, monkeypatch: pytest.MonkeyPatch) -> None:
    base = fresh_base()
    store = make_store("offload", base)
    store.create("a", A)
    store.create("c", C)
    _train(base, store, "a", 0)
    before = store.snapshot("a")

    def half_copied(state) -> None:  # e.g. out of device memory after part of the copy-in
        store.flat["weights"].zero_()
        raise RuntimeError("simulated failure during copy-in")

    monkeypatch.setattr(store, "_copy_in", half_copied)
    with pytest.raises(RuntimeError, match="simulated"):
        store.activate("c")
    monkeypatch.undo()
    store.activate("a")  # a was copied out before the failure: it comes back whole
    _assert_same(store.snapshot("a"), before)
    _train(base, store, "c", 0)  # and the store goes on working
    store.close()


def test_embedding_lora_is_trained_swapped_and_saved(fresh_base, tmp_path: Path) -> None:
    E = CandidateConfig(name="e", lora_rank=4, learning_rate=1e-2, target_modules=["embed_tokens", "q_proj"])
    base = fresh_base()
    store = make_store("offload", base)
    store.create("e", E)
    store.create("a", A)
    _train(base, store, "e", 0)
    store.activate("a")  # e now waits in host memory
    weights = {k: v for k, v in store.snapshot("e").items() if k.startswith("weight/") and "lora_embedding_A" in k}
    assert weights and all(
        v.abs().sum() > 0 for v in weights.values()
    )  # PEFT starts embedding A at zero: it was trained
    saved = safetensors.torch.load_file(str(store.save("e", tmp_path / "e") / ADAPTER_WEIGHTS))
    assert {k for k in saved if "lora_embedding" in k} == {k.removeprefix("weight/") for k in weights} | {
        k.removeprefix("weight/").replace("lora_embedding_A", "lora_embedding_B") for k in weights
    }


def _deltas(weights: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    return {a: scale * weights[a.replace(".lora_A.", ".lora_B.")] @ weights[a] for a in weights if ".lora_A." in a}


@pytest.mark.parametrize(
    "new_rank,new_alpha",
    [(4, 16), (8, 8), (16, 32)],
    ids=["same-rank-new-alpha", "higher-rank", "higher-rank-same-scale"],
)
def test_start_from_an_adapter_of_another_shape_keeps_its_update(
    fresh_base, tmp_path: Path, new_rank: int, new_alpha: int
) -> None:
    """A challenger of rank >= the champion's starts exactly where the champion is (same dW = s B A)."""
    base = fresh_base()
    store = make_store("offload", base)
    store.create("a", A)  # rank 4, alpha 16 (scale 4)
    _train(base, store, "a", 0)
    folder = store.save("a", tmp_path / "a")
    saved = safetensors.torch.load_file(str(folder / "adapter_model.safetensors"))
    wide = CandidateConfig(name="w", lora_rank=new_rank, lora_alpha=new_alpha)
    store.create("w", wide, init_dir=folder)
    got = {k.removeprefix("weight/"): v for k, v in store.snapshot("w").items() if k.startswith("weight/")}
    want, have = _deltas(saved, A.lora_alpha / A.lora_rank), _deltas(got, new_alpha / new_rank)
    assert set(want) == set(have)
    assert max((want[k] - have[k]).abs().max().item() for k in want) < 1e-6
    assert any(want[k].abs().max() > 0 for k in want)
    if new_rank > A.lora_rank:  # the extra directions stay trainable: fresh A rows, zero B columns
        a_key = next(k for k in got if ".lora_A." in k)
        assert got[a_key][A.lora_rank :].abs().sum() > 0
        assert got[a_key.replace(".lora_A.", ".lora_B.")][:, A.lora_rank :].abs().sum() == 0


def test_lower_rank_start_is_the_best_low_rank_approximation() -> None:
    from trainer.adapters.lora_tensors import fit_adapter

    g = torch.Generator().manual_seed(0)
    saved = {"m.lora_A.weight": torch.randn(8, 20, generator=g), "m.lora_B.weight": torch.randn(12, 8, generator=g)}
    fresh = {"m.lora_A.weight": torch.zeros(3, 20), "m.lora_B.weight": torch.zeros(12, 3)}
    got = fit_adapter(saved, fresh, saved_scale=2.0, scale=0.5)
    assert got["m.lora_A.weight"].shape == (3, 20) and got["m.lora_B.weight"].shape == (12, 3)
    delta = 2.0 * saved["m.lora_B.weight"] @ saved["m.lora_A.weight"]
    approx = 0.5 * got["m.lora_B.weight"] @ got["m.lora_A.weight"]
    sing = torch.linalg.svdvals(delta)
    # Eckart-Young: the error of the best rank-3 approximation is the norm of the dropped singular values
    torch.testing.assert_close(
        torch.linalg.matrix_norm(delta - approx), sing[3:].square().sum().sqrt(), rtol=1e-4, atol=1e-4
    )
