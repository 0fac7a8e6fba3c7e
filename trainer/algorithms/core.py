"""The loss, clip and step every update shares, whichever way its rows go through the base: one candidate
at a time (:func:`trainer.algorithms.update.update_step`) or all together in one forward/backward
(:func:`trainer.multi_lora.one_pass.update_step_one_pass`, on chunks of each candidate's rows).

- :func:`candidate_loss`: the candidate's algorithm's policy loss
  (:data:`trainer.algorithms.registry.ALGORITHMS`) plus ``kl_coef`` times the token-mean k3 KL to
  the reference (the base with adapters disabled, or the adapter at the round's start; Schulman 2020);
- :func:`clip_and_step`: clip the gradient norm to ``rl.update.max_grad_norm``, step AdamW only when
  the norm is finite, zero the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trainer.algorithms.batch import LossInputs
from trainer.algorithms.losses import kl_k3, masked_mean
from trainer.algorithms.registry import ALGORITHMS


def candidate_loss(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(loss, pg_loss, kl, policy metrics)`` of ``x``'s rows: ``loss = pg_loss + kl_coef * kl``, scalars with
    grad (``kl``: token mean over ``x.mask_BT``); the metrics are the policy loss's own (``train/clip_frac``,
    ``train/kto_z0``, ...)."""
    pg_loss, metrics = ALGORITHMS[x.candidate.algorithm].policy_loss(x)
    kl = masked_mean(kl_k3(x.logprobs_BT, x.ref_BT), x.mask_BT)
    return pg_loss + x.candidate.kl_coef * kl, pg_loss, kl, metrics


def clip_and_step(
    params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_grad_norm: float
) -> float:
    """Clip the gradients of ``params`` to ``max_grad_norm``, step ``optimizer`` when their norm is finite,
    and zero them. Returns the norm before clipping (not finite: nothing was stepped). A CPU-GPU sync point."""
    grad_norm = torch.nn.utils.clip_grad_norm_(list(params), max_grad_norm).item()
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
