"""One optimizer step of several candidates, all their rows through the resident base together, in chunks.

:func:`update_step_one_pass` is the step behind ``rl.update_mode = "one_pass"``
(:func:`trainer.multi_lora.train_one_pass` pulls the candidates out of the
adapter store and calls it). The step's rows of every candidate are cut into
chunks of at most ``rl.one_pass_chunk_tokens`` padded tokens
(:func:`plan_chunks`); each chunk mixes the candidates in proportion to their
row counts, its rows grouped by candidate (so the multi-adapter layer never
sorts), and goes through one adapters-off reference forward (no grad) and one
forward/backward in which each row goes through its own candidate's LoRA
weights. Gradients accumulate over the chunks, and only one chunk's
activations are alive at a time, so the step's peak memory is bounded by the
budget, not by K x rows.

Each candidate keeps its own loss normalisation over *all* its rows of the
step: a chunk's piece of candidate ``k`` contributes its token-mean loss times
``n_kc / N_k`` (its completion tokens in the chunk over the candidate's
completion tokens in the step, each at least 1 as :func:`trainer.losses.masked_mean`
clamps), which is ``sum of the piece's token losses / N_k``. Summed over the
chunks, that is the token mean over the candidate's whole batch, so the
gradient equals the unchunked one (and the sequential mode's) up to float
rounding. This holds because every algorithm that joins one-pass updates
(:data:`trainer.update.ONE_PASS_ALGORITHMS`: PPO-clip, GRPO) has a loss that is a
token mean over its batch plus ``kl_coef`` x a token-mean k3 KL; an algorithm
with batch-level terms (KTO's reference point) must stay sequential.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.base import ResidentBase
from trainer.config import CandidateConfig, RLConfig
from trainer.errors import TrainerConfigError
from trainer.losses import kl_k3, masked_mean
from trainer.profile import phase
from trainer.update import ALGORITHMS, ONE_PASS_ALGORITHMS, Batch, LossInputs


@dataclass
class OnePassMember:
    """One candidate of a one-pass step: its float32 LoRA parameters (PEFT saved keys) and its own AdamW."""

    candidate: CandidateConfig
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer


Chunk = list[tuple[int, list[int]]]
"""One forward/backward's rows: ``(member k, indices of rows of batches[k])`` in ascending ``k``."""


def plan_chunks(batches: Sequence[Batch], max_tokens: int, share_prompts: bool = True) -> list[Chunk]:
    """Cut the rows of all ``batches`` into chunks of at most ``max_tokens`` padded tokens.

    A chunk of ``R`` rows costs ``R x L`` tokens, ``L`` the step's longest
    prompt + completion (a chunk pads its rows to its own longest, at most
    ``L``); with ``share_prompts`` (:mod:`trainer.shared_prompts`) a chunk whose
    ``R`` rows hold ``U`` distinct (member, prompt) pairs costs
    ``min(R x L, U x Lp + R x Lc)``, ``Lp`` / ``Lc`` the step's longest prompt /
    completion. The unit of dealing is a member's rows of one prompt (a single
    row without ``share_prompts``), cut only when it alone is over the budget;
    units are dealt in proportion to each batch's size (a unit whose first row
    is row ``r`` of a batch of ``n`` at position ``(r + 1/2) / n``, ties by
    member), so every chunk mixes all members when it has room for them, and
    members that drew the same prompts have them in the same chunk (one
    reference forward of the prompt for all). Within a chunk, rows are grouped
    by member in ascending order and keep their batch order.

    Returns:
        the chunks, every row of every batch in exactly one; ``[]`` when there are no rows.

    Raises:
        TrainerConfigError: ``max_tokens`` < 1.
    """
    if max_tokens < 1:
        raise TrainerConfigError(f"one-pass chunk budget must be >= 1 token, got {max_tokens}")
    rows = [(p, c) for b in batches for p, c in zip(b.prompt_ids, b.completion_ids)]
    longest = max((len(p) + len(c) for p, c in rows), default=0)
    if longest == 0:
        return []
    prompt_max, completion_max = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)

    def cost(units: int, n_rows: int) -> int:
        plain = n_rows * longest
        return min(plain, units * prompt_max + n_rows * completion_max) if share_prompts else plain

    units: list[tuple[float, int, list[int]]] = []  # (position, member, rows)
    for k, b in enumerate(batches):
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for r, p in enumerate(b.prompt_ids):
            by_prompt.setdefault(tuple(p) if share_prompts else (r,), []).append(r)
        units += [((unit[0] + 0.5) / len(b.prompt_ids), k, unit) for unit in by_prompt.values()]
    units.sort(key=lambda u: (u[0], u[1]))
    chunks: list[dict[int, list[int]]] = []
    current: dict[int, list[int]] = {}
    n_units = n_rows = 0
    for _, k, unit_rows in units:
        pending = list(unit_rows)
        while pending:
            if current and cost(n_units + 1, n_rows + len(pending)) > max_tokens:  # no room here: a new chunk
                chunks.append(current)
                current, n_units, n_rows = {}, 0, 0
            take = len(pending)
            while take > 1 and cost(n_units + 1, n_rows + take) > max_tokens:
                take -= 1
            current.setdefault(k, []).extend(pending[:take])
            pending = pending[take:]
            n_units, n_rows = n_units + 1, n_rows + take
            if pending:  # the unit alone is over the budget: its rest goes on in new chunks
                chunks.append(current)
                current, n_units, n_rows = {}, 0, 0
    if current:
        chunks.append(current)
    return [[(k, sorted(chunk[k])) for k in sorted(chunk)] for chunk in chunks]


def _rows(batch: Batch, rows: Sequence[int]) -> Batch:
    """The sub-batch of ``batch`` with rows ``rows`` (in that order)."""
    return Batch(
        prompt_ids=[batch.prompt_ids[r] for r in rows],
        completion_ids=[batch.completion_ids[r] for r in rows],
        behaviour_logprobs=[batch.behaviour_logprobs[r] for r in rows],
        advantages=[batch.advantages[r] for r in rows],
        rewards=[batch.rewards[r] for r in rows],
        versions=[batch.versions[r] for r in rows],
        desirable=None if batch.desirable is None else [batch.desirable[r] for r in rows],
    )


def update_step_one_pass(
    base: ResidentBase, multi: object, members: Sequence[OnePassMember], rl: RLConfig, batches: Sequence[Batch]
) -> list[dict[str, float]]:
    """One AdamW step for each member, all members' rows through the base together, chunk by chunk.

    ``multi`` is a :class:`trainer.multi_lora.MultiLoRA` holding ``members[k].params``
    as adapter ``k``; rows of ``batches[k]`` go through adapter ``k``. The rows
    are cut by :func:`plan_chunks` (``rl.one_pass_chunk_tokens``); per chunk one
    reference forward (adapters off, no grad) and one forward/backward, the
    gradients accumulating. Each member's loss is what :func:`trainer.update.update_step`
    computes on its batch alone (its own token mean over all its rows, see the
    module docstring), so each adapter's gradient equals its gradient alone.
    A member whose loss is not finite in some chunk is left out of the
    backward from then on and not stepped; a member whose gradient norm is
    not finite is not stepped. Clipping (``rl.max_grad_norm``) is per member.

    Returns:
        per member, the metrics of :func:`trainer.update.update_step`
        (``train/loss``, ``train/pg_loss``, ``train/kl`` and the policy loss's
        token-mean metrics, e.g. ``train/clip_frac``: over all its rows);
        ``train/update_s`` is the member's equal share of the shared step's wall
        time (summed over the members: the step's wall time, as the
        sequential mode's per-candidate times add up), ``train/tokens_per_s``
        the step's completion tokens (all members) per second of its wall
        time, and ``train/chunks`` the number of forward/backward chunks.

    Raises:
        TrainerConfigError: a member's algorithm is not in :data:`trainer.update.ONE_PASS_ALGORITHMS`.
    """
    bad = [m.candidate.name for m in members if not ALGORITHMS[m.candidate.algorithm].one_pass]
    if bad:
        raise TrainerConfigError(
            f"candidates {bad}: one-pass updates support {sorted(ONE_PASS_ALGORITHMS)} only; train them sequentially"
        )
    started = time.perf_counter()
    for m in members:
        m.optimizer.zero_grad(set_to_none=True)
    base.model.train()
    tokens_K = [max(1, sum(len(c) for c in b.completion_ids)) for b in batches]  # each member's token-mean denominator
    sums: list[dict[str, float]] = [{"train/loss": 0.0, "train/pg_loss": 0.0, "train/kl": 0.0} for _ in members]
    finite = [True] * len(members)
    chunks = plan_chunks(batches, rl.one_pass_chunk_tokens, base.share_prompts)
    for chunk in chunks:
        prompts = [batches[k].prompt_ids[r] for k, rows in chunk for r in rows]
        completions = [batches[k].completion_ids[r] for k, rows in chunk for r in rows]
        adapter_B = [k for k, rows in chunk for _ in rows]
        with phase("time/reference_s"), torch.no_grad(), base.reference():  # rows of all members share each prompt
            ref_BT, _ = base.completion_logprobs(prompts, completions)
        with phase("time/forward_backward_s"):
            with base.reference():  # PEFT's adapters off: only the multi-adapter hooks apply, per row
                logprobs_all_BT, mask_all_BT = base.completion_logprobs(
                    prompts,
                    completions,
                    keys_B=adapter_B,  # a member's rows share its prompts' forward, never another member's
                    rows=lambda batch_rows: multi.active([adapter_B[b] for b in batch_rows]),  # type: ignore[attr-defined]
                )
            losses = []
            start = 0
            for k, rows in chunk:
                m, piece = members[k], _rows(batches[k], rows)
                s, e, T = start, start + len(rows), max(1, max(len(c) for c in piece.completion_ids))
                start = e
                logprobs_BT, ref_BT_k, mask_BT = logprobs_all_BT[s:e, :T], ref_BT[s:e, :T], mask_all_BT[s:e, :T]
                pg_loss, loss_metrics = ALGORITHMS[m.candidate.algorithm].policy_loss(
                    LossInputs(base, m.candidate, rl, piece, logprobs_BT, ref_BT_k, mask_BT)
                )
                kl = masked_mean(kl_k3(logprobs_BT, ref_BT_k), mask_BT)
                weight = max(1, sum(len(c) for c in piece.completion_ids)) / tokens_K[k]
                loss = (pg_loss + m.candidate.kl_coef * kl) * weight
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
            grad_norm = float("nan")
            if finite[k]:
                grad_norm = torch.nn.utils.clip_grad_norm_(list(m.params.values()), rl.max_grad_norm).item()
                if math.isfinite(grad_norm):
                    m.optimizer.step()
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
