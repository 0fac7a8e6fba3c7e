"""How a step's rows are cut into forward/backward chunks of at most ``rl.update.chunk_tokens`` padded tokens:
a one-pass step's (:func:`plan_chunks`, each chunk mixing the candidates, and :func:`sub_batch`, one chunk's
rows) and one candidate's (:func:`row_chunks`, :func:`chunked_logprobs`: the sequential update and KTO's
reference point)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from trainer.errors import TrainerConfigError
from trainer.algorithms.batch import Batch

if TYPE_CHECKING:
    from trainer.model.base import ResidentBase


Chunk = list[tuple[int, list[int]]]
"""One forward/backward's rows: ``(member k, indices of rows of batches[k])`` in ascending ``k``."""


def plan_chunks(batches: Sequence[Batch], max_tokens: int, share_prompts: bool = True) -> list[Chunk]:
    """Cut the rows of all ``batches`` into chunks of at most ``max_tokens`` padded tokens.

    A chunk of ``R`` rows costs ``R x L`` tokens, ``L`` the step's longest
    prompt + completion (a chunk pads its rows to its own longest, at most
    ``L``); with ``share_prompts`` (:mod:`trainer.model.logprobs`) a chunk whose
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


def sub_batch(batch: Batch, rows: Sequence[int]) -> Batch:
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


def row_chunks(
    prompt_ids: Sequence[list[int]], completion_ids: Sequence[list[int]], max_tokens: int, share_prompts: bool
) -> list[list[int]]:
    """The rows cut into chunks of at most ``max_tokens`` padded tokens (as :func:`plan_chunks` counts them;
    a row over the budget is a chunk alone), every row in exactly one chunk."""
    rows = Batch(list(prompt_ids), list(completion_ids), behaviour_logprobs=[], advantages=[], rewards=[], versions=[])
    return [r for chunk in plan_chunks([rows], max_tokens, share_prompts) for _, r in chunk]


def chunked_logprobs(
    base: ResidentBase, prompt_ids: Sequence[list[int]], completion_ids: Sequence[list[int]], chunks: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``base.completion_logprobs`` of all rows, run chunk by chunk under the active adapter, without grad:
    ``(logprobs_BT, mask_BT)`` as one call over all rows would return them."""
    B, T = len(prompt_ids), max(1, max((len(c) for c in completion_ids), default=1))
    logprobs_BT = torch.zeros((B, T), dtype=torch.float32, device=base.device)
    mask_BT = torch.zeros((B, T), dtype=torch.float32, device=base.device)
    with torch.no_grad():
        for rows in chunks:
            lp, mask = base.completion_logprobs([prompt_ids[r] for r in rows], [completion_ids[r] for r in rows])
            index = torch.tensor(rows, device=base.device)
            logprobs_BT[index, : lp.shape[1]] = lp.to(logprobs_BT.dtype)
            mask_BT[index, : mask.shape[1]] = mask.to(mask_BT.dtype)
    return logprobs_BT, mask_BT
