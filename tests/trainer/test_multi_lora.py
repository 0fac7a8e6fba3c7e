"""One-pass updates (trainer.multi_lora.one_pass, trainer.multi_lora.layer) equal the sequential path, in float32.

Three candidates of different ranks, alphas, learning rates and target
modules and uneven row counts; the offload and the resident store; groups of
2 adapters per pass; one chunk per pass or the rows cut into many chunks.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from trainer.adapters.store import make_store
from trainer.model.base import ResidentBase, load_base
from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.algorithms.losses import kl_k3, masked_mean
from trainer.errors import TrainerConfigError
from trainer.multi_lora.layer import MultiLoRA
from trainer.multi_lora.one_pass import _pull, live_params, one_pass_ok, train_one_pass
from trainer.algorithms.chunks import plan_chunks
from trainer.multi_lora.one_pass import update_step_one_pass
from trainer.algorithms.registry import ALGORITHMS
from trainer.algorithms.batch import Batch, LossInputs
from trainer.algorithms.update import update_step

from .adamw_tolerance import assert_adamw_weights_close
from trainer.types import RoundSpec
from trainer.data import round_inputs
from .grad_recorder import GradRecorder
from .float32_tolerance import GRAD_TOL, LOGPROB_TOL, assert_gradients_close, max_relative_error

CANDIDATES = [
    CandidateConfig(
        name="a", lora_rank=4, lora_alpha=8, learning_rate=1e-2, kl_coef=0.1, target_modules=["q_proj", "v_proj"]
    ),
    CandidateConfig(
        name="b",
        lora_rank=8,
        lora_alpha=32,
        learning_rate=3e-3,
        kl_coef=0.0,
        algorithm="ppo_clip",
        target_modules=["k_proj", "o_proj", "down_proj"],
    ),
    CandidateConfig(
        name="c",
        lora_rank=2,
        lora_alpha=2,
        learning_rate=5e-3,
        kl_coef=0.05,
        target_modules=["q_proj", "up_proj", "gate_proj"],
    ),
]
RL = RLConfig(update={"adapters_per_pass": 2})  # per-candidate clipping at 1.0 is part of what must match
CHUNKED = RLConfig(update={"adapters_per_pass": 2, "chunk_tokens": 30})  # 2-3 rows of <= 15 tokens per chunk


@pytest.fixture(scope="module")
def base(peaked_model: Path) -> ResidentBase:
    return load_base(ModelConfig(name=str(peaked_model), dtype="float32", device="cpu"))


def _batch(base: ResidentBase, seed: int, rows: int, nan: bool = False) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(10, 400, (int(n),), generator=g).tolist() for n in torch.randint(3, 10, (rows,), generator=g)
    ]
    completions = [
        torch.randint(10, 400, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (rows,), generator=g)
    ]
    with torch.no_grad(), base.reference():
        old_BT, _ = base.completion_logprobs(prompts, completions)
    old_BT = old_BT.float().cpu()
    old = [(old_BT[b, : len(c)] + 0.05 * torch.randn(len(c), generator=g)).tolist() for b, c in enumerate(completions)]
    adv = torch.randn(rows, generator=g).tolist()
    if nan:
        adv[0] = float("nan")
    return Batch(prompts, completions, old, adv, adv, ["v"] * rows)


def _store(base: ResidentBase, kind: str):
    store = make_store(kind, base, seed=0)
    for c in CANDIDATES:
        store.create(c.name, c)
    # non-zero B so A gets gradients from the first step (PEFT's fresh B is 0)
    g = torch.Generator().manual_seed(1)
    for c in CANDIDATES:
        store.activate(c.name)
        with torch.no_grad():
            for k, p in sorted(live_params(store, c.name).items()):
                if ".lora_B." in k:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return store


def _close(store) -> None:
    for name in list(store.names()):
        store.delete(name)
    store.close()


def _loss(base, c, batch, logprobs_BT, ref_BT, mask_BT):
    pg, _ = ALGORITHMS[c.algorithm].policy_loss(LossInputs(base, c, RL, batch, logprobs_BT, ref_BT, mask_BT))
    return pg + c.kl_coef * masked_mean(kl_k3(logprobs_BT, ref_BT), mask_BT)


def _gradients_alone(base, store, batches) -> dict[str, dict[str, torch.Tensor]]:
    """Each candidate's LoRA gradient from its own rows alone (the sequential path), per parameter name."""
    alone = {}
    for c, batch in zip(CANDIDATES, batches):
        optimizer = store.activate(c.name)
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad(), base.reference():
            ref_BT, _ = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
        lp_BT, mask_BT = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
        _loss(base, c, batch, lp_BT, ref_BT, mask_BT).backward()
        alone[c.name] = {k: p.grad.clone() for k, p in live_params(store, c.name).items()}
        optimizer.zero_grad(set_to_none=True)
    return alone


def test_mixed_pass_gradients_equal_each_adapter_alone(base: ResidentBase) -> None:
    check_mixed_pass(base)


def check_mixed_pass(base: ResidentBase) -> None:
    """Three candidates' rows, interleaved, through one forward/backward of the multi-adapter layer: each
    candidate's LoRA gradients equal those of its rows alone (test_architectures runs it on every architecture)."""
    store = _store(base, "resident")
    batches = [_batch(base, seed=k, rows=3 + k) for k in range(3)]
    alone = _gradients_alone(base, store, batches)

    members = [_pull(store, c) for c in CANDIDATES]
    multi = MultiLoRA(base.model, [(c.lora_alpha / c.lora_rank, m.params) for c, m in zip(CANDIDATES, members)])
    try:
        prompts = [p for b in batches for p in b.prompt_ids]
        completions = [x for b in batches for x in b.completion_ids]
        # rows deliberately interleaved: the layer sorts them by adapter itself
        order = sorted(range(len(prompts)), key=lambda i: (i * 7) % len(prompts))
        owner = [k for k, b in enumerate(batches) for _ in b.prompt_ids]
        with torch.no_grad(), base.reference():
            ref_BT, _ = base.completion_logprobs([prompts[i] for i in order], [completions[i] for i in order])
        with base.reference(), multi.active([owner[i] for i in order]):
            lp_BT, mask_BT = base.completion_logprobs([prompts[i] for i in order], [completions[i] for i in order])
        total = 0
        for k, (c, batch) in enumerate(zip(CANDIDATES, batches)):
            rows = [j for j, i in enumerate(order) if owner[i] == k]
            rows.sort(key=lambda j: order[j])  # the candidate's own row order
            T = max(len(x) for x in batch.completion_ids)
            total = total + _loss(base, c, batch, lp_BT[rows, :T], ref_BT[rows, :T], mask_BT[rows, :T])
        total.backward()
    finally:
        multi.close()
        _close(store)
    worst = max(
        assert_gradients_close({k: p.grad for k, p in m.params.items()}, alone[c.name], GRAD_TOL, c.name)
        for c, m in zip(CANDIDATES, members)
    )
    print(f"mixed pass vs each adapter alone: largest gradient error / GRAD_TOL {worst[0]:.3g} ({worst[1]})")


def _two_steps(
    base: ResidentBase, kind: str, one_pass: bool, batches: list[list[Batch]], rl: RLConfig = RL
) -> tuple[list[dict[str, dict[str, torch.Tensor]]], list[dict[str, dict[str, float]]]]:
    """Each candidate's snapshot before the first step and after every step, and the metrics of every step."""
    store = _store(base, kind)
    snapshots = [{c.name: store.snapshot(c.name) for c in CANDIDATES}]
    metrics = []
    try:
        for step_batches in batches:
            if one_pass:
                metrics.append(train_one_pass(base, store, list(zip(CANDIDATES, step_batches)), rl))
            else:
                metrics.append(
                    {
                        c.name: update_step(base, store.activate(c.name), c, RL, b)
                        for c, b in zip(CANDIDATES, step_batches)
                    }
                )
            snapshots.append({c.name: store.snapshot(c.name) for c in CANDIDATES})
        return snapshots, metrics
    finally:
        _close(store)


def _sequential_metrics_at(
    base: ResidentBase, kind: str, weights: dict[str, dict[str, torch.Tensor]], step_batches: list[Batch]
) -> dict[str, dict[str, float]]:
    """The sequential step's metrics of every candidate from the given weights (a snapshot's ``weight/`` keys):
    a step's loss, its parts and its gradient norm are computed before the optimizer moves anything, so they
    depend on the weights only, not on the AdamW state."""
    store = make_store(kind, base, seed=0)
    try:
        metrics = {}
        for c, batch in zip(CANDIDATES, step_batches):
            store.create(c.name, c)
            optimizer = store.activate(c.name)
            with torch.no_grad():
                for k, p in live_params(store, c.name).items():
                    p.copy_(weights[c.name][f"weight/{k}"])
            metrics[c.name] = update_step(base, optimizer, c, RL, batch)
        return metrics
    finally:
        _close(store)


def _worst(margins: list[tuple[float, str]]) -> str:
    ratio, where = max(margins)
    return f"{ratio:.3g} ({where})"


LOSS_TOL = 2e-5
"""A step's losses (token means) relative to the size of their terms (|advantage| x ratio, the KL): each term moves
with its token's log-prob (ratio = exp(logprob - old), k3 KL), which agrees to LOGPROB_TOL x the largest |log-prob|
(~15 nats on the peaked model): 1.5e-5 of a term, plus a few U for the mean itself."""


@pytest.mark.parametrize(("kind", "rl"), [("offload", RL), ("resident", RL), ("offload", CHUNKED)])
def test_one_pass_steps_equal_sequential_steps(base: ResidentBase, kind: str, rl: RLConfig) -> None:
    batches = [[_batch(base, seed=10 * s + k, rows=2 + k) for k in range(3)] for s in range(2)]
    seq, seq_m = _two_steps(base, kind, one_pass=False, batches=batches)
    joint, joint_m = _two_steps(base, kind, one_pass=True, batches=batches, rl=rl)
    start = seq[0]
    assert joint_m[-1]["a"]["train/chunks"] == (1.0 if rl is RL else len(plan_chunks(batches[1][:2], 30)))
    # the one-pass run's second step, against a sequential step from the same weights (its own after step 1)
    seq_at_joint = _sequential_metrics_at(base, kind, joint[1], batches[1])
    margins = []
    for c in CANDIDATES:
        name = c.name
        assert set(joint[-1][name]) == set(seq[-1][name])
        assert any(k.startswith("exp_avg/") for k in seq[-1][name])
        for s in (1, 2):  # after each step: weights and moments within the AdamW bound of the sequential run's
            ratio, key = assert_adamw_weights_close(
                joint[s][name],
                seq[s][name],
                c.learning_rate,
                GRAD_TOL,
                history=[x[name] for x in seq[1:s]],
                label=(name, s),
            )
            margins.append((ratio, f"{name} step {s} {key}"))
        moved = max(float((seq[-1][name][k] - start[name][k]).abs().max()) for k in start[name] if ".lora_A." in k)
        assert moved > 1e-4, (name, moved)  # the test compares weights that really changed
        # Each step's metrics against the sequential step's from the same weights (step 1: both start equal;
        # step 2: the sequential step rerun from the one-pass run's weights after step 1, since the two runs'
        # weights differ by the AdamW bound above, which the metrics would inherit): float32 rounding only.
        for step, (got, want) in enumerate(
            ((joint_m[0][name], seq_m[0][name]), (joint_m[1][name], seq_at_joint[name]))
        ):
            adv = batches[step][CANDIDATES.index(c)].advantages
            terms = sum(abs(a) for a in adv) / len(adv) + abs(want["train/pg_loss"]) + abs(want["train/kl"])
            tols = {
                # the losses are token means of terms of the size of |advantage| x ratio and of the KL, which
                # cancel (a: loss 0.014 = pg -0.149 + 0.1 x KL 1.633): rounding scales with the terms, not the mean
                **dict.fromkeys(("train/loss", "train/pg_loss", "train/kl"), LOSS_TOL * terms),
                "train/grad_norm": GRAD_TOL * want["train/grad_norm"],  # as tight as the gradients
                "train/clip_frac": 1e-6,  # a share of tokens: only a ratio within rounding of 1 +- clip moves it
            }
            for key, tol in tols.items():
                margins.append((abs(got[key] - want[key]) / tol, f"{name} step {step + 1} {key}"))
                assert abs(got[key] - want[key]) <= tol, (name, step + 1, key, got[key], want[key], tol)
            assert got["train/skipped_nonfinite"] == 0.0
    print(f"one-pass vs sequential ({kind}, {rl.update.chunk_tokens}-token chunks): diff / bound {_worst(margins)}")


@pytest.mark.parametrize("rl", [RL, CHUNKED])
def test_nan_loss_of_one_candidate_leaves_the_others_alone(base: ResidentBase, rl: RLConfig) -> None:
    batches = [[_batch(base, seed=100 + k, rows=3, nan=(k == 1)) for k in range(3)]]
    seq, seq_m = _two_steps(base, "offload", one_pass=False, batches=batches)
    joint, joint_m = _two_steps(base, "offload", one_pass=True, batches=batches, rl=rl)
    start, m = seq[0], joint_m[0]
    assert math.isnan(m["b"]["train/loss"]) and m["b"]["train/skipped_nonfinite"] == 1.0
    assert m["a"]["train/skipped_nonfinite"] == 0.0 and m["c"]["train/skipped_nonfinite"] == 0.0
    for k, v in start["b"].items():
        assert torch.equal(joint[1]["b"][k], v), k  # not stepped: weights exactly as before, no AdamW state
    assert not any(k.startswith("exp_avg/") for k in joint[1]["b"])
    margins = []
    for c in (CANDIDATES[0], CANDIDATES[2]):
        # one step on equal weights: the gradient norm (before clipping) agrees as tightly as the gradients
        assert m[c.name]["train/grad_norm"] == pytest.approx(seq_m[0][c.name]["train/grad_norm"], rel=GRAD_TOL)
        assert all(torch.isfinite(v).all() for v in joint[1][c.name].values())
        ratio, key = assert_adamw_weights_close(
            joint[1][c.name], seq[1][c.name], c.learning_rate, GRAD_TOL, label=c.name
        )
        margins.append((ratio, f"{c.name} {key}"))
    print(f"NaN isolation ({rl.update.chunk_tokens} tokens a chunk): largest diff / bound {_worst(margins)}")


@pytest.mark.parametrize("chunk_tokens", [100_000, 40, 1])
def test_chunked_step_gradients_equal_each_candidate_alone(base: ResidentBase, chunk_tokens: int) -> None:
    """Rows of every candidate spread over several chunks (uneven row counts: 7, 2 and 4): each candidate's
    gradient is still the one of its token-mean loss over all its rows (a per-chunk mean would differ)."""
    rl = RLConfig(
        update={"chunk_tokens": chunk_tokens, "max_grad_norm": 1e9}
    )  # no clipping: the raw gradient is compared
    store = _store(base, "resident")
    batches = [_batch(base, seed=200 + k, rows=n) for k, n in enumerate((7, 2, 4))]
    alone = _gradients_alone(base, store, batches)
    members = [_pull(store, c) for c in CANDIDATES]
    for m in members:
        m.optimizer = GradRecorder(list(m.params.values()))
    multi = MultiLoRA(base.model, [(c.lora_alpha / c.lora_rank, m.params) for c, m in zip(CANDIDATES, members)])
    try:
        started = time.perf_counter()
        metrics = update_step_one_pass(base, multi, members, rl, batches)
        wall_s = time.perf_counter() - started
    finally:
        multi.close()
        _close(store)
    # each candidate's update_s is its share of the shared step: they add up to the step's wall time
    assert 0 < sum(m["train/update_s"] for m in metrics) <= wall_s
    chunks = plan_chunks(batches, chunk_tokens)
    assert metrics[0]["train/chunks"] == len(chunks)
    if chunk_tokens < 100_000:  # the case under test: some candidate's rows lie in several chunks
        assert len(chunks) > 1 and max(sum(k == 0 for k, _ in ch) for ch in chunks) == 1
    worst = (0.0, "")
    for c, m in zip(CANDIDATES, members):
        assert isinstance(m.optimizer, GradRecorder) and m.optimizer.grads, c.name
        got = dict(zip(m.params, m.optimizer.grads))
        worst = max(worst, assert_gradients_close(got, alone[c.name], GRAD_TOL, (c.name, chunk_tokens)))
    print(
        f"chunks of {chunk_tokens} tokens vs each alone: largest gradient error / GRAD_TOL {worst[0]:.3g} ({worst[1]})"
    )


def test_lm_head_reads_a_contiguous_input(base: ResidentBase) -> None:
    """The LM head gets a contiguous [B, T+1, H] input: a strided slice of the hidden states makes torch's
    matmul copy the head's [H, V] weight once per row (on CPU ~56 MB per row for SmolLM2 in bf16)."""
    batch = _batch(base, seed=3, rows=4)
    seen: list[tuple[tuple[int, ...], bool]] = []
    head = base.model.get_output_embeddings()
    handle = head.register_forward_pre_hook(
        lambda m, args: seen.append((tuple(args[0].shape), args[0].is_contiguous()))
    )
    try:
        with torch.no_grad(), base.reference():
            base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
    finally:
        handle.remove()
    T = max(len(c) for c in batch.completion_ids)
    assert seen == [((4, T + 1, base.model.config.hidden_size), True)]


def _rows_batch(lengths: list[tuple[int, int]]) -> Batch:
    prompts = [[5] * p for p, _ in lengths]
    completions = [[6] * c for _, c in lengths]
    n = len(lengths)
    return Batch(prompts, completions, [[0.0] * c for _, c in lengths], [0.0] * n, [0.0] * n, ["v"] * n)


def test_plan_chunks_covers_every_row_once_within_the_budget_mixing_all_candidates() -> None:
    batches = [
        _rows_batch([(4, 2), (6, 4)]),
        _rows_batch([(3, 1), (5, 5), (2, 2), (7, 3), (4, 4)]),
        _rows_batch([(1, 1), (2, 2), (3, 3)]),
    ]
    longest = 10
    for budget, rows_per_chunk in ((50, 5), (10, 1), (1, 1), (10_000, 10)):
        chunks = plan_chunks(batches, budget)
        seen = sorted((k, r) for ch in chunks for k, rows in ch for r in rows)
        assert seen == [(k, r) for k, b in enumerate(batches) for r in range(len(b.prompt_ids))], budget
        assert len(chunks) == -(-10 // rows_per_chunk), budget
        for ch in chunks:
            members = [k for k, _ in ch]
            assert members == sorted(set(members))  # grouped by candidate, ascending: no sort in the layer
            assert all(rows == sorted(rows) for _, rows in ch)
            assert sum(len(rows) for _, rows in ch) * longest <= max(budget, longest)
            if rows_per_chunk >= 5:
                assert members == [0, 1, 2], (budget, ch)  # every chunk mixes all candidates
    assert plan_chunks([_rows_batch([])], 10) == []
    with pytest.raises(TrainerConfigError, match="chunk budget"):
        plan_chunks(batches, 0)


def test_grouped_kernel_path_matches_the_loop_forward(base: ResidentBase) -> None:
    """The padded grouped-matmul path (used on CUDA) gives the loop's outputs (forward; CPU kernel)."""
    from trainer.multi_lora import layer as multi_lora

    if multi_lora._GROUPED is None:
        pytest.skip("this torch has no grouped matmul")
    store = _store(base, "resident")
    members = [_pull(store, c) for c in CANDIDATES]
    batch = _batch(base, seed=7, rows=6)
    owner = [2, 0, 1, 0, 2, 1]
    out = []
    for grouped in (False, True):
        multi = MultiLoRA(
            base.model, [(c.lora_alpha / c.lora_rank, m.params) for c, m in zip(CANDIDATES, members)], grouped=grouped
        )
        try:
            with torch.no_grad(), base.reference(), multi.active(owner):
                out.append(base.completion_logprobs(batch.prompt_ids, batch.completion_ids)[0])
        finally:
            multi.close()
        assert multi.grouped is grouped  # the grouped kernel really ran (no fallback)
    _close(store)
    err = max_relative_error(out[1], out[0])  # the same sums in another order and blocking: float32 rounding
    print(f"grouped vs loop log-probs: largest error / LOGPROB_TOL {err / LOGPROB_TOL:.3g}")
    assert err < LOGPROB_TOL, err
    with torch.no_grad(), base.reference():
        plain = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)[0]
    assert (plain - out[0]).abs().max() > 1e-4  # the adapters did something


def test_embedding_targets_are_refused_and_train_sequentially(base: ResidentBase) -> None:
    """Embedding LoRA layers have no per-row linear form here: the layer refuses them, a round keeps them sequential."""
    assert not one_pass_ok(CandidateConfig(name="e", target_modules=["embed_tokens", "q_proj"]))
    assert one_pass_ok(CANDIDATES[0])
    tensors = {
        "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 10),
        "base_model.model.model.embed_tokens.lora_embedding_B": torch.zeros(64, 4),
    }
    with pytest.raises(TrainerConfigError, match="linear LoRA layers only"):
        MultiLoRA(base.model, [(1.0, tensors)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: bench/device_check.sh runs it on a GPU machine")
def test_grouped_kernel_gradients_equal_the_loop_on_cuda(peaked_model: Path) -> None:
    """On CUDA the one-pass layer uses the grouped matmul (ranks padded): its gradients equal the loop's (float32)."""
    from trainer.multi_lora import layer as multi_lora

    if multi_lora._GROUPED is None:
        pytest.skip("this torch has no grouped matmul")
    cuda = load_base(ModelConfig(name=str(peaked_model), dtype="float32", device="cuda"))
    store = _store(cuda, "resident")
    members = [_pull(store, c) for c in CANDIDATES]
    batch = _batch(cuda, seed=7, rows=6)
    owner = [2, 0, 1, 0, 2, 1]
    grads = []
    try:
        for grouped in (False, True):
            for m in members:
                for p in m.params.values():
                    p.grad = None
            multi = MultiLoRA(
                cuda.model,
                [(c.lora_alpha / c.lora_rank, m.params) for c, m in zip(CANDIDATES, members)],
                grouped=grouped,
            )
            try:
                with cuda.reference(), multi.active(owner):
                    lp_BT, mask_BT = cuda.completion_logprobs(batch.prompt_ids, batch.completion_ids)
                (lp_BT * mask_BT).sum().backward()
            finally:
                multi.close()
            if multi.grouped is not grouped:
                pytest.skip(
                    "the grouped kernel refused float32 LoRA weights on this GPU; the loop ran instead (see the log)"
                )
            grads.append(
                {(c.name, k): p.grad.clone() for c, m in zip(CANDIDATES, members) for k, p in m.params.items()}
            )
    finally:
        _close(store)
    for key, ref in grads[0].items():
        assert ref.abs().max() > 0, key
        err = float((grads[1][key] - ref).abs().max() / ref.abs().max())
        assert err < GRAD_TOL, (key, err)


def test_round_in_one_pass_mode(tiny_model: Path, tmp_path: Path) -> None:
    from trainer.round import run_round
    from trainer.tasks import reasoning_gym_prompts
    from trainer.data import snapshot_table, split_snapshot

    prompts = reasoning_gym_prompts(
        "basic_arithmetic", 12, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    train, heldout = split_snapshot(snapshot_table(prompts), 0.25)
    cands = [c.model_copy(update={"reward": [RewardTerm(fn="exact_answer")], "start": "fresh"}) for c in CANDIDATES]
    rl = RLConfig(
        steps_per_round=2,
        prompts_per_step=2,
        rollout={"group_size": 2, "max_new_tokens": 4, "engine": "hf"},
        gate={"eval_prompts": 2, "max_kl": 100.0},
        update={"mode": "one_pass", "adapters_per_pass": 2},
    )
    result = run_round(
        RoundSpec(ModelConfig(name=str(tiny_model), dtype="float32"), tuple(cands), rl),
        round_inputs(train, heldout),
        tmp_path / "r1",
    )
    assert [c.name for c in result.candidates] == ["a", "b", "c"]
    for c in result.candidates:
        assert len(c.step_metrics) == 2
        assert all(math.isfinite(m["train/loss"]) and "train/swap_s" in m for m in c.step_metrics)
        assert (c.adapter_dir / "adapter_model.safetensors").is_file()
    assert result.metrics["time/forward_backward_s"] > 0


def _grouped_batch(base: ResidentBase, seed: int, prompts: list[list[int]], group: int) -> Batch:
    """A GRPO-shaped batch: every prompt ``group`` times, each row its own completion."""
    g = torch.Generator().manual_seed(seed)
    rows = [p for p in prompts for _ in range(group)]
    completions = [
        torch.randint(10, 400, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (len(rows),), generator=g)
    ]
    with torch.no_grad(), base.reference():
        old_BT, _ = base.completion_logprobs(rows, completions)
    old = [old_BT[b, : len(c)].float().tolist() for b, c in enumerate(completions)]
    adv = torch.randn(len(rows), generator=g).tolist()
    return Batch(rows, completions, old, adv, adv, ["v"] * len(rows))


@pytest.mark.parametrize("chunk_tokens", [100_000, 40])
def test_one_pass_sharing_prompts_gives_each_candidate_its_gradient_alone(
    base: ResidentBase, chunk_tokens: int
) -> None:
    """Every candidate draws the same 2 prompts, 3 rows each: the reference pass runs each prompt once for all
    candidates, the policy pass once per candidate (its LoRA changes the prompt's forward); each candidate's
    gradient equals its gradient alone from whole rows."""
    rl = RLConfig(update={"chunk_tokens": chunk_tokens, "max_grad_norm": 1e9})
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 400, (n,), generator=g).tolist() for n in (5, 8)]
    store = _store(base, "resident")
    batches = [_grouped_batch(base, 300 + k, prompts, group=3) for k in range(3)]
    base.share_prompts = False
    try:
        alone = _gradients_alone(base, store, batches)
    finally:
        base.share_prompts = True
    members = [_pull(store, c) for c in CANDIDATES]
    for m in members:
        m.optimizer = GradRecorder(list(m.params.values()))
    multi = MultiLoRA(base.model, [(c.lora_alpha / c.lora_rank, m.params) for c, m in zip(CANDIDATES, members)])
    rows_in: list[int] = []
    handle = base.model.get_input_embeddings().register_forward_pre_hook(
        lambda m, args: rows_in.append(args[0].shape[0])
    )
    try:
        update_step_one_pass(base, multi, members, rl, batches)
    finally:
        handle.remove()
        multi.close()
        _close(store)
    if (
        chunk_tokens == 100_000
    ):  # one chunk: reference prompts 2 (shared by all), rows 18; policy prompts 3 x 2, rows 18
        assert rows_in == [2, 18, 6, 18]
    else:  # a chunk per (candidate, prompt): 3 rows of 1 prompt; min(3 x 14, 8 + 3 x 6) = 26 <= 40 < 2 x 26
        assert rows_in == [1, 3, 1, 3] * 6
    worst = (0.0, "")
    for c, m in zip(CANDIDATES, members):
        got = dict(zip(m.params, m.optimizer.grads))
        # float32 rounding: the chunks and the prompt / completion passes add up in another order
        worst = max(worst, assert_gradients_close(got, alone[c.name], GRAD_TOL, (c.name, chunk_tokens)))
    print(f"shared prompts, {chunk_tokens}-token chunks: largest gradient error / GRAD_TOL {worst[0]:.3g} ({worst[1]})")


def test_fresh_candidates_skip_the_reference_pass_with_the_same_update(base: ResidentBase) -> None:
    """At a fresh start (every LoRA B zero, as PEFT initialises) the policy is the reference model: the one-pass
    step runs no reference forward, and its update equals the step that ran one."""
    import trainer.multi_lora.one_pass as one_pass

    batches = [_batch(base, seed=k, rows=3 + k) for k in range(3)]
    weights = {}
    for skip in (True, False):
        store = make_store("offload", base, seed=0)
        for c in CANDIDATES:
            store.create(c.name, c)
        forwards: list[int] = []
        handle = base.model.get_input_embeddings().register_forward_pre_hook(lambda m, a: forwards.append(1))
        real = one_pass.at_the_base
        one_pass.at_the_base = real if skip else (lambda member: False)  # type: ignore[assignment]
        try:
            metrics = train_one_pass(base, store, list(zip(CANDIDATES, batches)), RL)
        finally:
            one_pass.at_the_base = real  # type: ignore[assignment]
            handle.remove()
        assert all(math.isfinite(m["train/loss"]) for m in metrics.values())
        # 2 groups of adapters_per_pass = 2 candidates, 1 chunk each, rows whole (no prompt repeats): one policy
        # forward per group, and one reference forward each where it is not skipped
        assert len(forwards) == (2 if skip else 4), forwards
        weights[skip] = {c.name: store.snapshot(c.name) for c in CANDIDATES}
        if skip:
            assert all(m["train/kl"] == 0.0 for m in metrics.values())
        _close(store)
    for c in CANDIDATES:
        moved = [k for k, v in weights[True][c.name].items() if ".lora_A." in k and v.abs().sum() > 0]
        assert moved  # B moved by the step; A has no gradient at B = 0 but keeps its random start
        for k, v in weights[True][c.name].items():
            torch.testing.assert_close(v, weights[False][c.name][k], rtol=1e-5, atol=1e-7)
