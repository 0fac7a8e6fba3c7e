"""One optimizer step of one candidate on the live adapter (``rl.update.mode = "sequential"``): the shared
loss (:func:`trainer.algorithms.core.candidate_loss`: its algorithm's policy loss plus ``kl_coef`` * k3 KL
to the reference), backward, then the shared clip and AdamW step (:func:`trainer.algorithms.core.clip_and_step`).

The reference is the base with adapters disabled, or, for a candidate with ``reference = "start"``, its own
adapter as it was at the round's start (:class:`StartReference`: a copy of those weights, swapped into the live
adapter for the reference's forward passes).

A step whose rows pad to more than ``rl.update.chunk_tokens`` tokens runs in chunks of rows
(:func:`trainer.algorithms.chunks.row_chunks`) with the same update: the log-probs of all rows first without grad, the loss and its
gradient with respect to each log-prob on the whole batch (so a loss over the batch, as KTO's reference
point or a sequence mean, stays exact), then per chunk one forward with grad and its backward with that
gradient. That costs one extra forward and bounds the step's activation memory by the chunk's."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch

from trainer.algorithms.batch import Batch, LossInputs
from trainer.algorithms.core import candidate_loss, clip_and_step
from trainer.config import CandidateConfig, RLConfig
from trainer.model.base import ResidentBase
from trainer.algorithms.chunks import chunked_logprobs, row_chunks
from trainer.timers import phase


def _params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class StartReference:
    """The reference policy of a candidate with ``reference = "start"``: its live adapter's weights when this is
    built (before its first step of the round: for ``start = "champion"`` the champion's), kept as a host copy
    (a LoRA's worth of host memory per such candidate; the adapter store's device budget is unchanged).

    :meth:`policy` runs a block with those weights in the live adapter and puts the trained ones back after,
    also when the block raises: two LoRA-sized copies per reference pass, no second adapter on the base and no
    change to the adapter store. The copies go through ``.data``, outside autograd's version counters: a loss may
    take reference log-probs after the policy's forward with grad (KTO's reference point), and the backward that
    follows sees the trained values again, bit for bit.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.weights = [p.detach().to("cpu", copy=True) for p in _params(optimizer)]

    @contextlib.contextmanager
    def policy(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """A block under the start weights. ``optimizer`` must hold the parameters of the adapter this was built
        from, live (the caller's duty: the offload store's one slot serves every candidate of its shape).

        Raises:
            RuntimeError: ``optimizer``'s parameters differ from the start weights in number or shape.
        """
        params = _params(optimizer)
        if [p.shape for p in params] != [w.shape for w in self.weights]:
            raise RuntimeError("the live adapter's parameters differ from those its start reference was taken from")
        trained = [p.data.clone() for p in params]
        try:
            for p, w in zip(params, self.weights):
                p.data.copy_(w)
            yield
        finally:
            for p, t in zip(params, trained):
                p.data.copy_(t)


def update_step(
    base: ResidentBase,
    optimizer: torch.optim.Optimizer,
    candidate: CandidateConfig,
    rl: RLConfig,
    batch: Batch,
    start: StartReference | None = None,
) -> dict[str, float]:
    """One AdamW step on the live adapter: loss = the algorithm's policy loss + kl_coef * k3 KL.

    The adapter being trained must be live (the store's ``activate``), and
    ``optimizer`` its optimizer; ``start`` is its reference when that is its round's start weights
    (``reference = "start"``), None for the base with adapters off. Returns ``train/loss``, ``train/pg_loss``,
    ``train/kl``, ``train/grad_norm``, ``train/tokens_per_s`` (completion
    tokens through forward+backward per second of update time),
    ``train/update_s``, ``train/skipped_nonfinite``, ``train/chunks`` (forward/backward chunks: above
    ``rl.update.chunk_tokens`` padded tokens the step runs in chunks, see the module docstring) and the policy loss's own
    metrics (``train/clip_frac`` for PPO-clip and offline IS, ``train/kto_z0``
    ... for KTO).
    """
    started = time.perf_counter()
    reference: Callable[[], AbstractContextManager[None]] = (
        base.reference if start is None else lambda: start.policy(optimizer)
    )
    optimizer.zero_grad(set_to_none=True)
    base.model.eval()  # no dropout: the behaviour policy (vLLM) has none, and chunked steps need deterministic passes
    chunks = row_chunks(batch.prompt_ids, batch.completion_ids, rl.update.chunk_tokens, base.share_prompts)
    if len(chunks) <= 1:  # one forward/backward (every step of short rows)
        with phase("time/reference_s"), torch.no_grad(), reference():
            ref_BT, _ = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
        with phase("time/forward_backward_s"):
            logprobs_BT, mask_BT = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
            loss, pg_loss, kl, loss_metrics = candidate_loss(
                LossInputs(base, candidate, rl, batch, logprobs_BT, ref_BT, mask_BT, reference)
            )
            loss.backward()
    else:  # the loss on all rows' log-probs (no grad), its gradient pushed back through each chunk's forward
        with phase("time/reference_s"), reference():
            ref_BT, _ = chunked_logprobs(base, batch.prompt_ids, batch.completion_ids, chunks)
        with phase("time/forward_backward_s"):
            logprobs_BT, mask_BT = chunked_logprobs(base, batch.prompt_ids, batch.completion_ids, chunks)
            logprobs_BT.requires_grad_(True)
            loss, pg_loss, kl, loss_metrics = candidate_loss(
                LossInputs(base, candidate, rl, batch, logprobs_BT, ref_BT, mask_BT, reference)
            )
            loss.backward()
            grad_BT = logprobs_BT.grad
            assert grad_BT is not None
            for rows in chunks:
                lp, _ = base.completion_logprobs(
                    [batch.prompt_ids[r] for r in rows], [batch.completion_ids[r] for r in rows]
                )
                lp.backward(grad_BT[torch.tensor(rows, device=base.device), : lp.shape[1]].to(lp.dtype))
    with phase("time/optimizer_s"):
        grad_norm = clip_and_step(_params(optimizer), optimizer, rl.update.max_grad_norm)
    elapsed = time.perf_counter() - started
    tokens = float(mask_BT.sum().item())
    return {
        "train/loss": loss.item(),
        "train/pg_loss": pg_loss.item(),
        "train/kl": kl.item(),
        **loss_metrics,
        "train/grad_norm": grad_norm,
        "train/tokens_per_s": tokens / max(elapsed, 1e-9),
        "train/update_s": elapsed,
        "train/skipped_nonfinite": float(not math.isfinite(grad_norm)),
        "train/chunks": float(len(chunks)),
    }
