"""bf16 base, float32 LoRA: dtype choice, dtypes of trainable state, and numerics against float32.

Tolerances (tiny random Llama, hidden 64, peaked final norm, 8 sequences):
per-token log-probs of a bf16 base differ from float32 by a mean absolute
difference below 0.05 nats, and one update step's loss by less than 0.02
absolute. These bound bf16's own rounding (8 significant bits: 2^-9 = 0.2% per
weight and activation), not the order of float32 sums: the bf16 matmul kernels
of different CPUs (AMX tiles, AVX512-BF16 dot products, oneDNN's AVX2 path)
all multiply bf16 values and accumulate in float32, and the element-wise
kernels (ATen's AVX-512, AVX2 or scalar ones) move where bf16 rounds. Measured
(printed by the test) under every kernel variant of docs/testing.md: 0.0070 to
0.0082 nats and a loss difference of 0.0006 to 0.0047.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.model import base as base_mod
from trainer.adapters.store import make_store
from trainer.model.base import load_base, pick_dtype
from trainer.config import CandidateConfig, ModelConfig, RLConfig
from trainer.algorithms.batch import Batch
from trainer.algorithms.update import update_step

LOGPROB_MAE_TOL = 0.05
LOSS_TOL = 0.02


def test_auto_dtype_follows_the_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert pick_dtype("float32", cpu) == torch.float32 and pick_dtype("bfloat16", cpu) == torch.bfloat16
    monkeypatch.setattr(base_mod, "cpu_has_bf16", lambda: True)
    assert pick_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(base_mod, "cpu_has_bf16", lambda: False)
    assert pick_dtype("auto", cpu) == torch.float32
    assert pick_dtype("float16", cpu) == torch.float16  # an explicit value overrides the hardware


def test_cpu_flags_are_read_from_proc() -> None:
    flags = Path("/proc/cpuinfo").read_text().split()
    assert base_mod.cpu_has_bf16() == ("amx_bf16" in flags or "avx512_bf16" in flags)


def _batch(base, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 400, (int(n),), generator=g).tolist() for n in torch.randint(4, 9, (8,), generator=g)]
    completions = [
        torch.randint(10, 400, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (8,), generator=g)
    ]
    with torch.no_grad():
        old_BT, _ = base.completion_logprobs(prompts, completions)
    old = [old_BT[b, : len(c)].tolist() for b, c in enumerate(completions)]
    adv = torch.randn(8, generator=g).tolist()
    return Batch(prompts, completions, old, adv, adv, ["v"] * 8)


def _step(model: Path, dtype: str) -> tuple[dict[str, float], torch.Tensor, object, object]:
    base = load_base(ModelConfig(name=str(model), dtype=dtype, device="cpu"))
    store = make_store("offload", base, seed=0)
    cand = CandidateConfig(name="c", learning_rate=1e-2, kl_coef=0.1, start="fresh")
    store.create("c", cand)
    optimizer = store.activate("c")
    batch = _batch(
        load_base(ModelConfig(name=str(model), dtype="float32", device="cpu"))
    )  # the same sequences and old log-probs
    with torch.no_grad():
        lp_BT, mask_BT = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
    metrics = update_step(base, optimizer, cand, RLConfig(), batch)
    return metrics, (lp_BT * mask_BT), mask_BT, (base, store, optimizer)


def test_bf16_base_keeps_lora_and_adamw_in_float32_and_matches_float32(peaked_model: Path) -> None:
    m32, lp32, mask, _ = _step(peaked_model, "float32")
    m16, lp16, _, (base, store, optimizer) = _step(peaked_model, "bfloat16")
    assert next(base.model.get_base_model().parameters()).dtype == torch.bfloat16
    assert lp16.dtype == torch.float32  # log-probs computed in float32 from bf16 logits
    lora = [p for g in optimizer.param_groups for p in g["params"]]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    states = [optimizer.state[p] for p in lora]
    assert all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32 for s in states)
    assert all(
        p.dtype == torch.float32 for n, p in base.model.named_parameters() if "lora_" in n
    )  # every adapter, boot too
    mae = float((lp16 - lp32).abs().sum() / mask.sum())
    print(
        f"bf16 vs fp32 per-token log-prob mean abs diff {mae:.4f} nats; loss {m16['train/loss']:.5f} vs {m32['train/loss']:.5f}"
    )
    assert 0 < mae < LOGPROB_MAE_TOL, mae
    assert abs(m16["train/loss"] - m32["train/loss"]) < LOSS_TOL, (m16["train/loss"], m32["train/loss"])
    assert m16["train/skipped_nonfinite"] == 0.0


def test_vllm_dtype_is_float32_on_cpu_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline import stack

    monkeypatch.setattr(stack, "_has_cuda", lambda: False)
    assert stack.vllm_dtype() == "float32" and stack.vllm_dtype("bfloat16") == "bfloat16"
    argv = stack.vllm_service(Path("/m"), "127.0.0.1", 1, Path("/tmp/l"), dtype="bfloat16").argv
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    monkeypatch.setattr(stack, "_has_cuda", lambda: True)
    assert stack.vllm_dtype() == "auto"


def test_trainer_logprobs_of_vllm_samples_fp32_and_bf16(vllm_tiny: str, tiny_model: Path) -> None:
    """Per-token log-probs of the trainer vs the (float32, CPU) vLLM's on vLLM's own samples, and the
    PPO ratio at step 0 (mean of exp(trainer - vLLM) over tokens). Tiny random model: its next-token
    distribution is near-uniform, so this understates bf16's error on a trained model."""
    from trainer.types import BASE_VERSION, RolloutRequest
    from trainer.rollout.vllm import VLLMEngine

    engine = VLLMEngine(vllm_tiny)
    b32 = load_base(ModelConfig(name=str(tiny_model), dtype="float32", device="cpu"))
    prompts = [b32.chat_token_ids([{"role": "user", "content": f"What is {i} + {2 * i}?"}]) for i in range(3)]
    requests = [
        RolloutRequest(
            version=BASE_VERSION,
            prompt_id=str(i),
            prompt_token_ids=tuple(p),
            n=4,
            max_new_tokens=12,
            temperature=1.0,
            seed=3,
        )
        for i, p in enumerate(prompts)
    ]
    groups = engine.generate(requests)
    ids = [prompts[i] for i, g in enumerate(groups) for _ in g]
    comps = [list(s.token_ids) for g in groups for s in g]
    vllm_BT = torch.zeros((len(comps), max(len(c) for c in comps)))
    for b, s in enumerate(s for g in groups for s in g):
        vllm_BT[b, : len(s.logprobs)] = torch.tensor(s.logprobs)
    report = {}
    for dtype, base in (
        ("float32", b32),
        ("bfloat16", load_base(ModelConfig(name=str(tiny_model), dtype="bfloat16", device="cpu"))),
    ):
        with torch.no_grad(), base.reference():
            lp_BT, mask_BT = base.completion_logprobs(ids, comps)
        mae = float(((lp_BT - vllm_BT).abs() * mask_BT).sum() / mask_BT.sum())
        ratio = float((torch.exp(lp_BT - vllm_BT) * mask_BT).sum() / mask_BT.sum())
        report[dtype] = (mae, ratio)
    print(f"trainer vs vLLM (float32) per-token log-probs, mean abs diff / PPO ratio at step 0: {report}")
    assert report["float32"][0] < 1e-3
    assert report["bfloat16"][0] < LOGPROB_MAE_TOL
    assert all(abs(ratio - 1.0) < 0.01 for _, ratio in report.values())
