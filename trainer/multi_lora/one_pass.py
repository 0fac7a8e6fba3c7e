"""One optimizer step of several candidates, all their rows through the resident base together, in chunks.

:func:`update_step_one_pass` is the step behind ``rl.update.mode = "one_pass"``
(:func:`train_one_pass` pulls the candidates out of the adapter store and calls it). The step's rows of every candidate are cut into
chunks of at most ``rl.update.chunk_tokens`` padded tokens
(:func:`trainer.algorithms.chunks.plan_chunks`); each chunk mixes the candidates in proportion to their
row counts, its rows grouped by candidate (so the multi-adapter layer never
sorts), and goes through one adapters-off reference forward (no grad) and one
forward/backward in which each row goes through its own candidate's LoRA
weights. Gradients accumulate over the chunks, and only one chunk's
activations are alive at a time, so the step's peak memory is bounded by the
budget, not by K x rows. When every candidate of the step is still at the base
(all its LoRA B matrices zero, as PEFT initialises a fresh adapter: the first
step of a ``start = "fresh"`` candidate), its LoRA terms are exactly zero, the
policy forward computes the reference's log-probs, and the reference pass is
skipped (:func:`at_the_base`).

Each candidate keeps its own loss normalisation over *all* its rows of the
step: a chunk's piece of candidate ``k`` contributes its token-mean loss times
``n_kc / N_k`` (its completion tokens in the chunk over the candidate's
completion tokens in the step, each at least 1 as :func:`trainer.algorithms.losses.masked_mean`
clamps), which is ``sum of the piece's token losses / N_k``. Summed over the
chunks, that is the token mean over the candidate's whole batch, so the
gradient equals the unchunked one (and the sequential mode's) up to float
rounding. This holds because every algorithm that joins one-pass updates
(:data:`trainer.algorithms.registry.ONE_PASS_ALGORITHMS`: PPO-clip, GRPO) has a loss that is a
token mean over its batch plus ``kl_coef`` x a token-mean k3 KL; an algorithm
with batch-level terms (KTO's reference point) must stay sequential. The loss of each piece and each
member's clip and step are the sequential mode's own (:mod:`trainer.algorithms.core`).

:func:`train_one_pass` runs a step of several candidates this way
(:func:`update_step_one_pass`: the rows in chunks of
``rl.update.chunk_tokens`` padded tokens, gradients accumulated, so the
step's memory does not grow with K x rows). Each candidate keeps its own
parameters, AdamW (own learning rate and state) and loss normalisation (a
token mean over all its rows of the step), so each adapter's gradient is the
one it would get alone. The weights and AdamW state are copied from the
adapter store into per-pass float32 parameters before the pass and written
back after it (two store activations and two copies of each candidate's LoRA
tensors and moments per step: small next to a forward/backward, and the
stores stay unchanged).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer.model.base import ResidentBase
from trainer.config import CandidateConfig, RLConfig
from trainer.errors import TrainerConfigError
from trainer.algorithms.core import candidate_loss, clip_and_step
from trainer.adapters.lora_tensors import adapter_params, make_adamw, peft_name
from trainer.multi_lora.layer import MultiLoRA
from trainer.algorithms.chunks import plan_chunks, sub_batch
from trainer.timers import phase
from trainer.algorithms.registry import ALGORITHMS, ONE_PASS_ALGORITHMS
from trainer.algorithms.batch import Batch, LossInputs

if TYPE_CHECKING:
    from trainer.adapters.store import AdapterStore


@dataclass
class OnePassMember:
    """One candidate of a one-pass step: its float32 LoRA parameters (PEFT saved keys) and its own AdamW."""

    candidate: CandidateConfig
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer


def update_step_one_pass(
    base: ResidentBase, multi: object, members: Sequence[OnePassMember], rl: RLConfig, batches: Sequence[Batch]
) -> list[dict[str, float]]:
    """One AdamW step for each member, all members' rows through the base together, chunk by chunk.

    ``multi`` is a :class:`trainer.multi_lora.layer.MultiLoRA` holding ``members[k].params``
    as adapter ``k``; rows of ``batches[k]`` go through adapter ``k``. The rows
    are cut by :func:`plan_chunks` (``rl.update.chunk_tokens``); per chunk one
    reference forward (adapters off, no grad) and one forward/backward, the
    gradients accumulating. Each member's loss is what :func:`trainer.algorithms.update.update_step`
    computes on its batch alone (its own token mean over all its rows, see the
    module docstring), so each adapter's gradient equals its gradient alone.
    A member whose loss is not finite in some chunk is left out of the
    backward from then on and not stepped; a member whose gradient norm is
    not finite is not stepped. Clipping (``rl.update.max_grad_norm``) is per member.

    Returns:
        per member, the metrics of :func:`trainer.algorithms.update.update_step`
        (``train/loss``, ``train/pg_loss``, ``train/kl`` and the policy loss's
        token-mean metrics, e.g. ``train/clip_frac``: over all its rows);
        ``train/update_s`` is the member's equal share of the shared step's wall
        time (summed over the members: the step's wall time, as the
        sequential mode's per-candidate times add up), ``train/tokens_per_s``
        the step's completion tokens (all members) per second of its wall
        time, and ``train/chunks`` the number of forward/backward chunks.

    Raises:
        TrainerConfigError: a member's algorithm is not in :data:`trainer.algorithms.registry.ONE_PASS_ALGORITHMS`.
    """
    bad = [m.candidate.name for m in members if not ALGORITHMS[m.candidate.algorithm].one_pass]
    if bad:
        raise TrainerConfigError(
            f"candidates {bad}: one-pass updates support {sorted(ONE_PASS_ALGORITHMS)} only; train them sequentially"
        )
    started = time.perf_counter()
    for m in members:
        m.optimizer.zero_grad(set_to_none=True)
    base.model.eval()  # no dropout: the behaviour policy (vLLM) has none, and chunked steps need deterministic passes
    tokens_K = [max(1, sum(len(c) for c in b.completion_ids)) for b in batches]  # each member's token-mean denominator
    sums: list[dict[str, float]] = [{"train/loss": 0.0, "train/pg_loss": 0.0, "train/kl": 0.0} for _ in members]
    finite = [True] * len(members)
    chunks = plan_chunks(batches, rl.update.chunk_tokens, base.share_prompts)
    at_reference = all(at_the_base(m) for m in members)  # a fresh candidate's first step: no reference pass needed
    for chunk in chunks:
        prompts = [batches[k].prompt_ids[r] for k, rows in chunk for r in rows]
        completions = [batches[k].completion_ids[r] for k, rows in chunk for r in rows]
        adapter_B = [k for k, rows in chunk for _ in rows]
        if not at_reference:
            with phase("time/reference_s"), torch.no_grad(), base.reference():  # rows of all members share prompts
                ref_BT, _ = base.completion_logprobs(prompts, completions)
        with phase("time/forward_backward_s"):
            with base.reference():  # PEFT's adapters off: only the multi-adapter hooks apply, per row
                logprobs_all_BT, mask_all_BT = base.completion_logprobs(
                    prompts,
                    completions,
                    keys_B=adapter_B,  # a member's rows share its prompts' forward, never another member's
                    rows=lambda batch_rows: multi.active([adapter_B[b] for b in batch_rows]),  # type: ignore[attr-defined]
                )
            if at_reference:  # every LoRA delta is exactly zero: the policy's log-probs are the reference's
                ref_BT = logprobs_all_BT.detach()
            losses = []
            start = 0
            for k, rows in chunk:
                m, piece = members[k], sub_batch(batches[k], rows)
                s, e, T = start, start + len(rows), max(1, max(len(c) for c in piece.completion_ids))
                start = e
                logprobs_BT, ref_BT_k, mask_BT = logprobs_all_BT[s:e, :T], ref_BT[s:e, :T], mask_all_BT[s:e, :T]
                unweighted, pg_loss, kl, loss_metrics = candidate_loss(
                    LossInputs(base, m.candidate, rl, piece, logprobs_BT, ref_BT_k, mask_BT)
                )
                weight = max(1, sum(len(c) for c in piece.completion_ids)) / tokens_K[k]
                loss = unweighted * weight
                for key, value in {
                    "train/loss": loss.item(),
                    "train/pg_loss": pg_loss.item() * weight,
                    "train/kl": kl.item() * weight,
                    **{key: v * weight for key, v in loss_metrics.items()},
                }.items():
                    sums[k][key] = sums[k].get(key, 0.0) + value
                finite[k] = finite[k] and math.isfinite(sums[k]["train/loss"])
                if finite[k]:
                    losses.append(loss)
            if losses:
                torch.stack(losses).sum().backward()
    with phase("time/optimizer_s"):
        for k, m in enumerate(members):
            if finite[k]:
                grad_norm = clip_and_step(list(m.params.values()), m.optimizer, rl.update.max_grad_norm)
            else:  # its loss was not finite in some chunk: left out of the backward, not stepped
                grad_norm = float("nan")
                m.optimizer.zero_grad(set_to_none=True)
            sums[k]["train/grad_norm"] = grad_norm
            sums[k]["train/skipped_nonfinite"] = float(not math.isfinite(grad_norm))
    elapsed = time.perf_counter() - started
    tokens = float(sum(sum(len(c) for c in b.completion_ids) for b in batches))
    for r in sums:
        r["train/tokens_per_s"] = tokens / max(elapsed, 1e-9)
        r["train/update_s"] = elapsed / len(members)
        r["train/chunks"] = float(len(chunks))
    return sums


def at_the_base(member: OnePassMember) -> bool:
    """True when every LoRA B matrix of the member is zero (PEFT's initialisation of a fresh adapter): its
    policy is then the reference model itself, and the step's reference pass would repeat the policy's forward."""
    return all(not bool(p.any()) for k, p in member.params.items() if ".lora_B." in k)


def live_params(store: AdapterStore, name: str) -> dict[str, torch.nn.Parameter]:
    """The live adapter's parameters after ``store.activate(name)``, keyed by PEFT's saved names."""
    slot = getattr(store, "slot_params", None)
    if slot is not None:  # OffloadStore: the one device slot
        return dict(slot)
    return adapter_params(store.base.model, peft_name(name))  # ResidentStore


def _pull(store: AdapterStore, candidate: CandidateConfig) -> OnePassMember:
    """A float32 copy of a candidate's LoRA weights with an AdamW holding a copy of its state."""
    optimizer = store.activate(candidate.name)
    live = live_params(store, candidate.name)
    params = {k: torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for k, p in live.items()}
    mine = make_adamw(list(params.values()), candidate.learning_rate)
    for k, p in live.items():
        state = optimizer.state.get(p)
        if state and "exp_avg" in state:
            mine.state[params[k]] = {f: torch.as_tensor(state[f]).clone() for f in ("step", "exp_avg", "exp_avg_sq")}
    return OnePassMember(candidate=candidate, params=params, optimizer=mine)


def _push(store: AdapterStore, member: OnePassMember) -> None:
    """Write a member's weights and AdamW state back into the store (in place where the store has state)."""
    name = member.candidate.name
    optimizer = store.activate(name)
    live = live_params(store, name)
    with torch.no_grad():
        for k, p in live.items():
            mine = member.params[k]
            p.copy_(mine)
            new = member.optimizer.state.get(mine)
            if not new:
                continue
            old = optimizer.state.get(p)
            if old and "exp_avg" in old:
                for f in ("step", "exp_avg", "exp_avg_sq"):
                    old[f].copy_(new[f])
            else:
                optimizer.state[p] = {f: new[f].clone() for f in ("step", "exp_avg", "exp_avg_sq")}


def train_one_pass(
    base: ResidentBase, store: AdapterStore, work: Sequence[tuple[CandidateConfig, Batch]], rl: RLConfig
) -> dict[str, dict[str, float]]:
    """One optimizer step for each ``(candidate, batch)``, ``rl.update.adapters_per_pass`` candidates per forward/backward.

    Per group: pull the candidates' weights and AdamW state out of the store,
    run the step over all their rows (:func:`trainer.multi_lora.one_pass.update_step_one_pass`:
    per chunk of ``rl.update.chunk_tokens`` padded tokens one reference pass and
    one forward/backward), push the results back. A candidate whose loss or gradient is not finite is
    not stepped (``train/skipped_nonfinite`` = 1); the others are unaffected.

    Returns:
        candidate name -> the step's metrics (the keys of :func:`trainer.algorithms.update.update_step`,
        plus ``train/chunks`` and ``train/swap_s``: this candidate's share of the pull + push time).

    Raises:
        TrainerConfigError: a candidate with embedding LoRA layers (train it sequentially).
    """
    out: dict[str, dict[str, float]] = {}
    g = rl.update.adapters_per_pass
    for first in range(0, len(work), g):
        group = work[first : first + g]
        started = time.perf_counter()
        with phase("time/optimizer_s"):
            members = [_pull(store, c) for c, _ in group]
        pull_s = time.perf_counter() - started
        multi = MultiLoRA(base.model, [(c.lora_alpha / c.lora_rank, m.params) for (c, _), m in zip(group, members)])
        try:
            metrics = update_step_one_pass(base, multi, members, rl, [b for _, b in group])
        finally:
            multi.close()
        started = time.perf_counter()
        with phase("time/optimizer_s"):
            for m in members:
                _push(store, m)
        swap_s = (pull_s + time.perf_counter() - started) / len(group)
        for (c, _), step_metrics in zip(group, metrics):
            out[c.name] = {"train/swap_s": swap_s, **step_metrics}
    return out


def one_pass_ok(candidate: CandidateConfig) -> bool:
    """True when the candidate's LoRA layers are all linear ones (embedding targets train sequentially)."""
    return not any(t in ("embed_tokens", "wte", "wpe") for t in candidate.target_modules)
