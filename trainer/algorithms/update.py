"""One optimizer step of one candidate on the live adapter (``rl.update.mode = "sequential"``): the shared
loss (:func:`trainer.algorithms.core.candidate_loss`: its algorithm's policy loss plus ``kl_coef`` * k3 KL
to the reference, the base with adapters disabled), backward, then the shared clip and AdamW step
(:func:`trainer.algorithms.core.clip_and_step`).

A step whose rows pad to more than ``rl.update.chunk_tokens`` tokens runs in chunks of rows
(:func:`trainer.algorithms.chunks.row_chunks`) with the same update: the log-probs of all rows first without grad, the loss and its
gradient with respect to each log-prob on the whole batch (so a loss over the batch, as KTO's reference
point or a sequence mean, stays exact), then per chunk one forward with grad and its backward with that
gradient. That costs one extra forward and bounds the step's activation memory by the chunk's."""

from __future__ import annotations

import math
import time

import torch

from trainer.algorithms.batch import Batch, LossInputs
from trainer.algorithms.core import candidate_loss, clip_and_step
from trainer.config import CandidateConfig, RLConfig
from trainer.model.base import ResidentBase
from trainer.algorithms.chunks import chunked_logprobs, row_chunks
from trainer.timers import phase


def update_step(
    base: ResidentBase, optimizer: torch.optim.Optimizer, candidate: CandidateConfig, rl: RLConfig, batch: Batch
) -> dict[str, float]:
    """One AdamW step on the live adapter: loss = the algorithm's policy loss + kl_coef * k3 KL.

    The adapter being trained must be live (the store's ``activate``), and
    ``optimizer`` its optimizer. Returns ``train/loss``, ``train/pg_loss``,
    ``train/kl``, ``train/grad_norm``, ``train/tokens_per_s`` (completion
    tokens through forward+backward per second of update time),
    ``train/update_s``, ``train/skipped_nonfinite``, ``train/chunks`` (forward/backward chunks: above
    ``rl.update.chunk_tokens`` padded tokens the step runs in chunks, see the module docstring) and the policy loss's own
    metrics (``train/clip_frac`` for PPO-clip and offline IS, ``train/kto_z0``
    ... for KTO).
    """
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    base.model.eval()  # no dropout: the behaviour policy (vLLM) has none, and chunked steps need deterministic passes
    chunks = row_chunks(batch.prompt_ids, batch.completion_ids, rl.update.chunk_tokens, base.share_prompts)
    if len(chunks) <= 1:  # one forward/backward (every step of short rows)
        with phase("time/reference_s"), torch.no_grad(), base.reference():
            ref_BT, _ = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
        with phase("time/forward_backward_s"):
            logprobs_BT, mask_BT = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
            loss, pg_loss, kl, loss_metrics = candidate_loss(
                LossInputs(base, candidate, rl, batch, logprobs_BT, ref_BT, mask_BT)
            )
            loss.backward()
    else:  # the loss on all rows' log-probs (no grad), its gradient pushed back through each chunk's forward
        with phase("time/reference_s"), base.reference():
            ref_BT, _ = chunked_logprobs(base, batch.prompt_ids, batch.completion_ids, chunks)
        with phase("time/forward_backward_s"):
            logprobs_BT, mask_BT = chunked_logprobs(base, batch.prompt_ids, batch.completion_ids, chunks)
            logprobs_BT.requires_grad_(True)
            loss, pg_loss, kl, loss_metrics = candidate_loss(
                LossInputs(base, candidate, rl, batch, logprobs_BT, ref_BT, mask_BT)
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
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grad_norm = clip_and_step(params, optimizer, rl.update.max_grad_norm)
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
