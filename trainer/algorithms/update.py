"""One optimizer step of one candidate on the live adapter (``rl.update.mode = "sequential"``): the shared
loss (:func:`trainer.algorithms.core.candidate_loss`: its algorithm's policy loss plus ``kl_coef`` * k3 KL
to the reference, the base with adapters disabled), backward, then the shared clip and AdamW step
(:func:`trainer.algorithms.core.clip_and_step`)."""

from __future__ import annotations

import math
import time

import torch

from trainer.algorithms.batch import Batch, LossInputs
from trainer.algorithms.core import candidate_loss, clip_and_step
from trainer.config import CandidateConfig, RLConfig
from trainer.model.base import ResidentBase
from trainer.timers import phase


def update_step(
    base: ResidentBase, optimizer: torch.optim.Optimizer, candidate: CandidateConfig, rl: RLConfig, batch: Batch
) -> dict[str, float]:
    """One AdamW step on the live adapter: loss = the algorithm's policy loss + kl_coef * k3 KL.

    The adapter being trained must be live (the store's ``activate``), and
    ``optimizer`` its optimizer. Returns ``train/loss``, ``train/pg_loss``,
    ``train/kl``, ``train/grad_norm``, ``train/tokens_per_s`` (completion
    tokens through forward+backward per second of update time),
    ``train/update_s``, ``train/skipped_nonfinite`` and the policy loss's own
    metrics (``train/clip_frac`` for PPO-clip and offline IS, ``train/kto_z0``
    ... for KTO).
    """
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    base.model.train()
    with phase("time/reference_s"), torch.no_grad(), base.reference():
        ref_BT, _ = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
    with phase("time/forward_backward_s"):
        logprobs_BT, mask_BT = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
        loss, pg_loss, kl, loss_metrics = candidate_loss(
            LossInputs(base, candidate, rl, batch, logprobs_BT, ref_BT, mask_BT)
        )
        loss.backward()
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
    }
