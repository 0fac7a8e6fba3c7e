"""A sequential update step above ``rl.update.chunk_tokens`` runs in chunks of rows with the same gradient
(trainer.algorithms.update, trainer.algorithms.chunks), for GRPO, PPO-clip and KTO (whose reference point is a
batch-level term, so a per-chunk loss would differ), in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.adapters.store import make_store
from trainer.algorithms.batch import Batch
from trainer.algorithms.update import StartReference, update_step
from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.model.base import ResidentBase, load_base
from trainer.algorithms.chunks import chunked_logprobs, row_chunks
from trainer.multi_lora.one_pass import live_params

from .grad_recorder import GradRecorder
from .float32_tolerance import GRAD_TOL, LOGPROB_TOL, assert_gradients_close, max_relative_error

ROWS = 9


@pytest.fixture(scope="module")
def base(peaked_model: Path) -> ResidentBase:
    return load_base(ModelConfig(name=str(peaked_model), dtype="float32", device="cpu"))


def _batch(base: ResidentBase, kto: bool) -> Batch:
    """Rows of uneven lengths; every third prompt repeats (rows sharing a prompt, as G samples do)."""
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(10, 400, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (ROWS,), generator=g)
    ]
    for r in range(2, ROWS, 3):
        prompts[r] = prompts[r - 1]
    completions = [
        torch.randint(10, 400, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (ROWS,), generator=g)
    ]
    adv = torch.randn(ROWS, generator=g).tolist()
    if kto:
        return Batch(prompts, completions, [[] for _ in prompts], adv, adv, ["v"] * ROWS, [a > 0 for a in adv])
    with torch.no_grad(), base.reference():
        old_BT, _ = base.completion_logprobs(prompts, completions)
    old = [(old_BT[b, : len(c)] + 0.05 * torch.randn(len(c), generator=g)).tolist() for b, c in enumerate(completions)]
    return Batch(prompts, completions, old, adv, adv, ["v"] * ROWS)


def _off_the_base(store, name: str) -> dict[str, torch.nn.Parameter]:
    """The live adapter ``name`` with a non-zero B (every LoRA weight gets a gradient; it is not the base)."""
    params = live_params(store, name)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k, p in sorted(params.items()):
            if ".lora_B." in k:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return params


def _step(base: ResidentBase, candidate: CandidateConfig, batch: Batch, chunk_tokens: int):
    """One update step on a fresh adapter (non-zero B, so every LoRA weight gets a gradient): its metrics and
    gradients, recorded before any optimizer step. With ``reference = "start"`` the reference is that adapter;
    the live weights are checked to be the adapter's again after the step (the recorder steps nothing)."""
    store = make_store("resident", base, seed=0)
    try:
        store.create(candidate.name, candidate)
        store.activate(candidate.name)
        params = _off_the_base(store, candidate.name)
        names = sorted(params)
        recorder = GradRecorder([params[k] for k in names])
        rl = RLConfig(update={"chunk_tokens": chunk_tokens, "max_grad_norm": 1e9})  # no clipping: raw gradients
        start = StartReference(recorder) if candidate.reference == "start" else None
        before = {k: p.detach().clone() for k, p in params.items()}
        metrics = update_step(base, recorder, candidate, rl, batch, start)
        assert all(torch.equal(params[k], before[k]) for k in names)
        return metrics, dict(zip(names, recorder.grads))
    finally:
        for name in list(store.names()):
            store.delete(name)
        store.close()


@pytest.mark.parametrize("algorithm", ["grpo", "ppo_clip", "kto"])
def test_a_chunked_sequential_step_has_the_gradient_of_the_whole_step(base: ResidentBase, algorithm: str) -> None:
    reward = [RewardTerm(fn="logged" if algorithm == "kto" else "exact_answer")]
    candidate = CandidateConfig(name="c", lora_rank=4, lora_alpha=8, kl_coef=0.1, algorithm=algorithm, reward=reward)
    batch = _batch(base, kto=algorithm == "kto")
    whole, want = _step(base, candidate, batch, chunk_tokens=100_000)
    chunked, got = _step(base, candidate, batch, chunk_tokens=30)
    assert whole["train/chunks"] == 1.0
    assert chunked["train/chunks"] >= 4  # the rows really lie in several chunks
    for key in ("train/loss", "train/pg_loss", "train/kl"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
    assert set(got) == set(want) and len(got) > 0
    assert_gradients_close(got, want, GRAD_TOL, algorithm)


def test_chunked_logprobs_equal_one_call_and_cover_every_row_once(base: ResidentBase) -> None:
    batch = _batch(base, kto=True)
    chunks = row_chunks(batch.prompt_ids, batch.completion_ids, 30, base.share_prompts)
    assert sorted(r for rows in chunks for r in rows) == list(range(ROWS))
    assert len(chunks) > 1
    with torch.no_grad():
        want_BT, want_mask_BT = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
    got_BT, got_mask_BT = chunked_logprobs(base, batch.prompt_ids, batch.completion_ids, chunks)
    assert torch.equal(got_mask_BT, want_mask_BT.float())
    assert max_relative_error(got_BT * got_mask_BT, want_BT.float() * want_mask_BT) < LOGPROB_TOL


def test_a_base_with_dropout_in_its_config_updates_deterministically(peaked_model: Path) -> None:
    """A hostile-input pass gave the tiny Llama attention_dropout 0.3: the update ran the base in train mode, so
    every pass drew other dropout masks (chunked vs whole: loss 1.5 % apart, grad norm 1.35 vs 1.12; two whole
    steps apart too). The behaviour policy (vLLM) has no dropout; neither do the updates now."""
    base = load_base(ModelConfig(name=str(peaked_model), dtype="float32", device="cpu"))
    layers = [m for m in base.model.modules() if hasattr(m, "attention_dropout")]
    assert layers
    for m in layers:
        m.attention_dropout = 0.3
    candidate = CandidateConfig(
        name="c", lora_rank=4, lora_alpha=8, kl_coef=0.1, reward=[RewardTerm(fn="exact_answer")]
    )
    batch = _batch(base, kto=False)
    first, want = _step(base, candidate, batch, chunk_tokens=100_000)
    again, same = _step(base, candidate, batch, chunk_tokens=100_000)
    chunked, got = _step(base, candidate, batch, chunk_tokens=30)
    assert again["train/loss"] == first["train/loss"] and all(torch.equal(same[k], want[k]) for k in want)
    assert chunked["train/loss"] == pytest.approx(first["train/loss"], rel=1e-5, abs=1e-6)
    assert_gradients_close(got, want, GRAD_TOL, "dropout")


@pytest.mark.parametrize("algorithm", ["grpo", "kto"])
def test_a_start_reference_is_the_adapter_itself_and_a_chunked_step_has_the_whole_steps_gradient(
    base: ResidentBase, algorithm: str
) -> None:
    """``reference = "start"`` on the adapter's first step: the policy is its own reference (KL 0, KTO's log-ratios
    0), unlike the base's reference; the start weights swapped in for KTO's reference point after the policy's
    forward with grad leave the backward exact (the chunked step takes every log-prob without grad first)."""
    reward = [RewardTerm(fn="logged" if algorithm == "kto" else "exact_answer")]
    fields = dict(name="c", lora_rank=4, lora_alpha=8, kl_coef=0.1, algorithm=algorithm, reward=reward)
    batch = _batch(base, kto=algorithm == "kto")
    on_base, base_grads = _step(base, CandidateConfig(**fields), batch, chunk_tokens=100_000)
    start = CandidateConfig(**fields, reference="start")
    whole, want = _step(base, start, batch, chunk_tokens=100_000)
    chunked, got = _step(base, start, batch, chunk_tokens=30)
    assert whole["train/kl"] == pytest.approx(0.0, abs=1e-6)
    assert on_base["train/kl"] > 1e-3  # the adapter is not the base
    if algorithm == "kto":
        for key in ("train/kto_logratio_desirable", "train/kto_logratio_undesirable"):
            assert whole[key] == pytest.approx(0.0, abs=1e-5), key
            assert abs(on_base[key]) > 1e-3, key
        assert whole["train/kto_z0"] == pytest.approx(0.0, abs=1e-5)
    for key in ("train/loss", "train/pg_loss", "train/kl"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
    assert_gradients_close(got, want, GRAD_TOL, f"{algorithm} start reference")
    assert any(not torch.allclose(want[k], base_grads[k]) for k in want)  # the reference changed the update


def test_a_start_reference_stays_the_round_start_while_the_adapter_trains(base: ResidentBase) -> None:
    """After AdamW steps the reference block runs the weights the adapter had when the reference was taken, and
    the block ends with the trained weights live again."""
    candidate = CandidateConfig(
        name="c",
        lora_rank=4,
        lora_alpha=8,
        algorithm="kto",
        reward=[RewardTerm(fn="logged")],
        reference="start",
        learning_rate=1e-2,
    )
    batch = _batch(base, kto=True)
    store = make_store("resident", base, seed=0)
    try:
        store.create(candidate.name, candidate)
        optimizer = store.activate(candidate.name)
        start = StartReference(optimizer)
        with torch.no_grad():
            at_start_BT, mask_BT = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
        rl = RLConfig()
        metrics = [update_step(base, optimizer, candidate, rl, batch, start) for _ in range(3)]
        with torch.no_grad():
            trained_BT, _ = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
            with start.policy(optimizer):
                reference_BT, _ = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
            again_BT, _ = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
        real = mask_BT.bool()
        assert torch.equal(reference_BT[real], at_start_BT[real])
        assert torch.equal(again_BT[real], trained_BT[real])
        assert (trained_BT[real] - at_start_BT[real]).abs().max() > 1e-3  # it did train
        assert metrics[0]["train/kl"] == pytest.approx(0.0, abs=1e-6) and metrics[-1]["train/kl"] > 1e-6
    finally:
        store.delete(candidate.name)
        store.close()


def test_a_start_reference_trains_alike_in_the_offload_stores_shared_slot(base: ResidentBase) -> None:
    """The offload store's one device slot serves every candidate: a start-reference candidate trained there
    beside a base-reference one, their steps interleaved, ends where it ends alone on the resident store."""
    fields = dict(lora_rank=4, lora_alpha=8, algorithm="kto", reward=[RewardTerm(fn="logged")], learning_rate=1e-2)
    own, other = CandidateConfig(name="a", reference="start", **fields), CandidateConfig(name="b", **fields)
    batch = _batch(base, kto=True)

    def train(kind: str, candidates: list[CandidateConfig]) -> dict[str, torch.Tensor]:
        store = make_store(kind, base, seed=0)
        try:
            starts: dict[str, StartReference] = {}
            for c in candidates:
                store.create(c.name, c)
                store.activate(c.name)
                _off_the_base(store, c.name)
            for _ in range(3):
                for c in candidates:
                    optimizer = store.activate(c.name)
                    if c.reference == "start":
                        starts.setdefault(c.name, StartReference(optimizer))
                    update_step(base, optimizer, c, RLConfig(), batch, starts.get(c.name))
            return store.snapshot(own.name)
        finally:
            for name in list(store.names()):
                store.delete(name)
            store.close()

    alone = train("resident", [own])
    shared = train("offload", [own, other])
    assert set(shared) == set(alone) and len(alone) > 0
    for k in alone:
        assert torch.allclose(shared[k], alone[k], rtol=1e-5, atol=1e-6), k
