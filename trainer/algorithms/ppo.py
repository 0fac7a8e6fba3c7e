"""PPO-clip on fresh rollouts, and GRPO as its group-normalised variant: rollout groups -> rewards ->
advantages (``grpo``: group-normalised, Shao et al. 2024; ``ppo_clip``: reward minus the group mean, no
std scaling) -> the token-level PPO-clip surrogate (Schulman et al. 2017)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from trainer.algorithms.batch import Advantages, Batch, LossInputs, StepData, pad_rows
from trainer.algorithms.losses import ppo_clip_loss
from trainer.errors import DataError
from trainer.rewards import RewardMix
from trainer.types import Prompt, Sample


def mean_baseline(rewards_PG: torch.Tensor) -> torch.Tensor:
    """PPO-clip without a value model: each group's mean reward is the baseline (no std scaling)."""
    return rewards_PG - rewards_PG.mean(dim=1, keepdim=True)


def rollout_batch(
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[list[int]],
    groups: Sequence[Sequence[Sample]],
    reward: RewardMix,
    advantages: Advantages,
    extra_metadata_PG: Sequence[Sequence[dict]] | None = None,
) -> tuple[Batch, dict[str, float]]:
    """Score rollout groups (``P`` prompts x ``G`` samples) and compute ``advantages`` of the rewards
    (:func:`trainer.algorithms.losses.group_advantages` for GRPO, :func:`mean_baseline` for PPO-clip).

    ``extra_metadata_PG[p][g]`` is merged into prompt ``p``'s metadata when scoring
    sample ``g`` (e.g. ``reward_model_score``, the reward model's score of that sample).
    """
    extra = extra_metadata_PG or [[{}] * len(group) for group in groups]
    rewards_PG = torch.tensor(
        [
            [reward(p.messages, s.text, {**p.metadata, **x}) for s, x in zip(group, xs)]
            for p, group, xs in zip(prompts, groups, extra)
        ],
        dtype=torch.float64,
    )
    advantages_PG = advantages(rewards_PG)
    batch = Batch(
        prompt_ids=[list(ids) for ids, group in zip(prompt_ids, groups) for _ in group],
        completion_ids=[list(s.token_ids) for group in groups for s in group],
        behaviour_logprobs=[list(s.logprobs) for group in groups for s in group],
        advantages=advantages_PG.flatten().tolist(),
        rewards=rewards_PG.flatten().tolist(),
        versions=[s.adapter_version for group in groups for s in group],
    )
    signal = (rewards_PG.std(dim=1, unbiased=False) > 0).double().mean().item()
    metrics = {
        "train/reward_mean": rewards_PG.mean().item(),
        "train/reward_std": rewards_PG.std(unbiased=False).item(),
        "train/groups_with_signal": signal,
    }
    return batch, metrics


def rollout_builder(advantages: Advantages) -> Callable[[StepData], tuple[Batch, dict[str, float]]]:
    def build(data: StepData) -> tuple[Batch, dict[str, float]]:
        if data.groups is None:
            raise DataError(f"candidate {data.candidate.name!r} ({data.candidate.algorithm}) needs rollout groups")
        return rollout_batch(
            data.prompts, data.prompt_ids, data.groups, data.reward, advantages, data.extra_metadata_PG
        )

    return build


def ppo_loss(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    old_BT = pad_rows(x.batch.behaviour_logprobs, x.logprobs_BT.shape[1], x.base.device)
    advantages_B = torch.tensor(x.batch.advantages, dtype=torch.float32, device=x.base.device)
    loss, clip_frac = ppo_clip_loss(x.logprobs_BT, old_BT, advantages_B, x.mask_BT, x.rl.update.clip_eps)
    return loss, {"train/clip_frac": clip_frac.item()}
