"""Policy-gradient losses for LoRA RL rounds.

Shape letters: ``B`` sequences (prompt x sample), ``T`` completion tokens,
``V`` vocabulary, ``P`` prompts, ``G`` samples per prompt (the GRPO group).
Masks are 1.0 on real completion tokens and 0.0 on padding; every loss is a
token mean over the mask (all real tokens of the batch count equally, as in
DAPO / Dr. GRPO "token-level" reduction).
"""

from __future__ import annotations

import torch


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Token mean over the mask: ``sum(values * mask) / max(sum(mask), 1)`` -> scalar."""
    mask_BT = mask_BT.to(values_BT.dtype)
    return (values_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1.0)


def group_advantages(rewards_PG: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO group-normalised advantages: ``[P, G] -> [P, G]``.

    ``A_pg = (r_pg - mean_g r_pg) / (std_g r_pg + eps)`` with the population
    standard deviation of each prompt's group. A group whose rewards are all
    equal gets advantage 0 (no signal). Source: Shao et al. 2024,
    "DeepSeekMath", section 4.1.2 (outcome supervision).
    """
    mean_P1 = rewards_PG.mean(dim=1, keepdim=True)
    std_P1 = rewards_PG.std(dim=1, keepdim=True, unbiased=False)
    return (rewards_PG - mean_P1) / (std_P1 + eps)


def ppo_clip_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level PPO-clip surrogate, returned as a loss to minimise.

    ``ratio_t = exp(logprobs_t - old_logprobs_t)``;
    ``loss_t = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)``;
    token mean over ``mask_BT``. ``old_logprobs_BT`` are the rollout engine's
    log-probabilities of the sampled tokens (the behaviour policy).
    Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7.

    Args:
        logprobs_BT: current policy log-probs of the sampled tokens ``[B, T]`` (with grad).
        old_logprobs_BT: behaviour log-probs ``[B, T]`` (no grad).
        advantages_B: one advantage per sequence ``[B]``.
        mask_BT: 1.0 on real completion tokens ``[B, T]``.
        clip_eps: epsilon of the clip range.

    Returns:
        ``(loss, clip_frac)``: scalar loss, and the fraction of real tokens
        whose ratio lies outside ``[1 - eps, 1 + eps]``.
    """
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT.detach())
    adv_B1 = advantages_B.detach().unsqueeze(1)
    unclipped_BT = ratio_BT * adv_B1
    clipped_BT = ratio_BT.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv_B1
    loss = masked_mean(-torch.minimum(unclipped_BT, clipped_BT), mask_BT)
    clip_frac = masked_mean(((ratio_BT - 1.0).abs() > clip_eps).float(), mask_BT)
    return loss, clip_frac.detach()


def kl_k3(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): ``[B, T] -> [B, T]``.

    With tokens sampled from the policy and ``r = ref_logprob - logprob``:
    ``k3 = exp(r) - r - 1`` (unbiased, always >= 0). Source: Schulman 2020,
    "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html);
    used as GRPO's KL term in DeepSeekMath eq. 4.
    """
    log_ratio_BT = ref_logprobs_BT.detach() - logprobs_BT
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1.0


def importance_weighted_pg_loss(
    logprobs_BT: torch.Tensor,
    behaviour_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    max_ratio: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Offline importance-weighted policy gradient with truncated ratios.

    ``w_t = min(exp(logprobs_t - behaviour_logprobs_t), max_ratio)`` (no grad);
    ``loss_t = -w_t * A * logprobs_t``; token mean over ``mask_BT``. The
    gradient is the off-policy policy gradient with per-token truncated
    importance weights (truncated IS: Ionides 2008; as in V-trace's rho-bar,
    Espeholt et al. 2018, "IMPALA"). ``behaviour_logprobs_BT`` are the logged
    log-probabilities of the policy that served the row.

    Returns:
        ``(loss, clip_frac)``: scalar loss, fraction of real tokens whose
        weight was truncated at ``max_ratio``.
    """
    ratio_BT = torch.exp(logprobs_BT.detach() - behaviour_logprobs_BT.detach())
    weight_BT = ratio_BT.clamp(max=max_ratio)
    loss = masked_mean(-weight_BT * advantages_B.detach().unsqueeze(1) * logprobs_BT, mask_BT)
    clip_frac = masked_mean((ratio_BT > max_ratio).float(), mask_BT)
    return loss, clip_frac


def sequence_logprobs(logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """log pi(y | x) of each completion: the sum of its token log-probs over the mask, ``[B, T] -> [B]``."""
    return (logprobs_BT * mask_BT.to(logprobs_BT.dtype)).sum(dim=1)


def kto_loss(
    policy_logps_B: torch.Tensor,
    reference_logps_B: torch.Tensor,
    desirable_B: torch.Tensor,
    policy_kl_logps_B: torch.Tensor,
    reference_kl_logps_B: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO loss on binary feedback, returned as a loss to minimise.

    With the implicit reward ``r_b = policy_logps_b - reference_logps_b``
    (sequence sums of log-probs) and the reference point
    ``z0 = max(0, mean_b(policy_kl_logps_b - reference_kl_logps_b))``
    (detached; computed on mismatched prompt/completion pairs of the batch):

    - desirable ``b``: ``loss_b = desirable_weight * (1 - sigmoid(beta * (r_b - z0)))``
    - undesirable ``b``: ``loss_b = undesirable_weight * (1 - sigmoid(beta * (z0 - r_b)))``

    and the loss is the mean of ``loss_b`` over the batch. Source: Ethayarajh
    et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization",
    eq. 7-8; TRL ``KTOTrainer.kto_loss`` (``loss_type="kto"``), whose KL
    completions are the batch's completions shifted by one.

    Args:
        policy_logps_B: log pi(y_b | x_b) ``[B]`` (with grad).
        reference_logps_B: log pi_ref(y_b | x_b) ``[B]`` (no grad).
        desirable_B: True where ``y_b`` is desirable (thumbs up) ``[B]`` bool.
        policy_kl_logps_B: log pi(y'_b | x_b) on mismatched pairs ``[B']`` (detached here).
        reference_kl_logps_B: log pi_ref(y'_b | x_b) ``[B']``.
        beta: scale of the implicit reward (> 0).
        desirable_weight, undesirable_weight: per-class loss weights (> 0).

    Returns:
        ``(loss, z0)``: scalar loss and the detached reference point.
    """
    z0 = (policy_kl_logps_B.detach() - reference_kl_logps_B.detach()).mean().clamp(min=0.0)
    logratio_B = policy_logps_B - reference_logps_B.detach()
    desirable_B = desirable_B.to(torch.bool)
    desirable_loss_B = desirable_weight * (1.0 - torch.sigmoid(beta * (logratio_B - z0)))
    undesirable_loss_B = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - logratio_B)))
    loss_B = torch.where(desirable_B, desirable_loss_B, undesirable_loss_B)
    return loss_B.mean(), z0
