"""The evaluation KL: the serving engine's log-probs of its greedy answers against one adapters-off
pass of the trainer's base over every candidate's answers (real engines on the tiny model)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from trainer.adapters.store import make_store
from trainer.model.base import ResidentBase, load_base
from trainer.config import CandidateConfig, ModelConfig, RLConfig
from trainer.errors import RolloutError
from trainer.evaluation.measure import greedy_answers, kl_to_base, reference_logprobs
from trainer.algorithms.losses import kl_k3
from trainer.rollout.hf import HFEngine
from trainer.rollout.vllm import VLLMEngine
from trainer.types import Prompt, Sample

LORA = CandidateConfig(name="x", lora_rank=8, target_modules=["q_proj", "v_proj", "o_proj"])


def _prompts(base: ResidentBase, n: int = 8) -> tuple[list[Prompt], list[list[int]]]:
    prompts = [
        Prompt(prompt_id=f"h{i}", messages=[{"role": "user", "content": f"What is {i} + {i}?"}]) for i in range(n)
    ]
    return prompts, [base.chat_token_ids(p.messages) for p in prompts]


def _perturb(store, name: str, seed: int, scale: float) -> None:
    store.activate(name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in store.slot_params.values():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@torch.no_grad()
def _two_pass_kl(base: ResidentBase, store, name: str, ids: list[list[int]], samples: list[Sample]) -> float:
    """The former computation: the live adapter's forward against an adapters-off forward."""
    store.activate(name)
    comps = [list(s.token_ids) for s in samples]
    logprobs_BT, mask_BT = base.completion_logprobs(ids, comps)
    with base.reference():
        ref_BT, _ = base.completion_logprobs(ids, comps)
    return float(((kl_k3(logprobs_BT, ref_BT) * mask_BT).sum(1) / mask_BT.sum(1)).mean())


@pytest.mark.integration
@pytest.mark.parametrize("engine_kind", ["hf", "vllm"])
def test_engine_kl_is_zero_for_an_untrained_adapter_and_matches_two_passes_for_a_trained_one(
    engine_kind: str, request: pytest.FixtureRequest, tiny_model: Path, tmp_path: Path
) -> None:
    base = load_base(ModelConfig(name=str(tiny_model)))  # bf16 where the CPU has it; vLLM on CPU runs float32
    store = make_store("offload", base)
    engine: HFEngine | VLLMEngine = (
        VLLMEngine(request.getfixturevalue("vllm_tiny")) if engine_kind == "vllm" else HFEngine(base, store)
    )
    store.create("zero", LORA.model_copy(update={"name": "zero"}))  # B = 0: the base itself
    store.create("hot", LORA.model_copy(update={"name": "hot"}))
    _perturb(store, "hot", seed=3, scale=0.5)
    for name in ("zero", "hot"):
        engine.load(name, f"{name}-s0", store.save(name, tmp_path / name))
    try:
        prompts, ids = _prompts(base)
        answers = greedy_answers(engine, ["zero-s0", "hot-s0"], prompts, ids, RLConfig(rollout={"max_new_tokens": 8}))
        reference = reference_logprobs(base, ids, answers)
        zero = kl_to_base(answers["zero-s0"], reference["zero-s0"])
        hot = kl_to_base(answers["hot-s0"], reference["hot-s0"])
        hot_two_pass = _two_pass_kl(base, store, "hot", ids, answers["hot-s0"])
        print(f"{engine_kind}: zero {zero:.3e}, hot {hot:.4f}, hot two-pass {hot_two_pass:.4f}")
        assert 0.0 <= zero < 1e-4  # measured: 0 (HF), 2.6e-6 (vLLM float32 vs bf16 base)
        assert hot > 0.05, "the perturbed adapter must be far from the base"
        assert hot == pytest.approx(hot_two_pass, rel=0.02, abs=1e-4)  # measured: 0.1331 vs 0.1331, 0.1350 vs 0.1351
    finally:
        for version in list(engine.versions):
            engine.unload(version)
        store.close()


def _sample(token_ids: tuple[int, ...], logprobs: tuple[float, ...]) -> Sample:
    return Sample(prompt_id="p", text="", token_ids=token_ids, logprobs=logprobs, adapter_version="v")


def test_kl_leaves_out_empty_answers_and_is_nan_without_tokens_or_with_a_nan() -> None:
    ref = torch.tensor([-1.0, -2.0])
    one = kl_to_base([_sample((1, 2), (-1.5, -2.0))], [ref])
    r = 0.5  # ref - policy on the first token, 0 on the second
    assert one == pytest.approx((math.exp(r) - r - 1) / 2)
    assert kl_to_base([_sample((1, 2), (-1.5, -2.0)), _sample((), ())], [ref, None]) == pytest.approx(one)
    assert math.isnan(kl_to_base([_sample((), ())], [None]))
    assert math.isnan(kl_to_base([_sample((1, 2), (float("nan"), -2.0))], [ref]))
    with pytest.raises(RolloutError, match="0 log-probs for 2 tokens"):
        kl_to_base([_sample((1, 2), ())], [ref])
    with pytest.raises(ValueError, match=r"expected \(2,\)"):
        kl_to_base([_sample((1, 2), (-1.0, -1.0))], [torch.tensor([-1.0])])


def test_answers_several_versions_gave_alike_are_scored_once(tiny_model: Path) -> None:
    """Identical answers to one prompt share one row of the reference pass; every version still gets the
    log-probs of its own answer, equal to scoring that answer alone."""
    base = load_base(ModelConfig(name=str(tiny_model), dtype="float32"))
    ids = [[11, 12, 13], [21, 22]]
    same, other = (5, 6, 7), (8, 9)

    def answers_of(*tokens: tuple[int, ...]) -> list[Sample]:
        return [Sample(f"p{i}", "", t, (), "v") for i, t in enumerate(tokens)]

    answers = {"a": answers_of(same, other), "b": answers_of(same, same[:2]), "c": answers_of(same, ())}
    rows: list[int] = []
    handle = base.model.get_input_embeddings().register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    try:
        got = reference_logprobs(base, ids, answers)
    finally:
        handle.remove()
    assert rows == [2, 3]  # 2 distinct prompts once, then 3 distinct answers: (5, 6, 7) once for a, b and c
    assert got["c"][1] is None  # no tokens, no log-probs
    for version, samples in answers.items():
        for i, sample in enumerate(samples):
            if sample.token_ids:
                alone = reference_logprobs(base, [ids[i]], {version: [sample]})[version][0]
                assert got[version][i] is not None and alone is not None
                torch.testing.assert_close(got[version][i], alone, rtol=1e-5, atol=1e-6)
    assert got["a"][0] is got["b"][0] is got["c"][0]
