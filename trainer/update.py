"""One optimizer step of one candidate: build the batch, score it, update.

- :func:`rollout_batch`: rollout groups -> rewards -> advantages (``grpo``:
  group-normalised, Shao et al. 2024; ``ppo_clip``: reward minus the group
  mean, no std scaling).
- :func:`offline_batch`: logged rows (completion, logged log-probs, reward) ->
  advantages (reward minus the batch mean, over the batch std).
- :func:`update_step`: policy loss (PPO-clip, or truncated importance-weighted
  PG for ``offline_is``) + ``kl_coef`` * k3 KL to the reference (the base with
  adapters disabled), backward, clip, AdamW step.

Each returns its result and a metrics dict with namespaced keys.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.base import ResidentBase
from trainer.config import CandidateConfig, RLConfig
from trainer.errors import DataError
from trainer.losses import group_advantages, importance_weighted_pg_loss, kl_k3, masked_mean, ppo_clip_loss
from trainer.rewards import RewardMix
from trainer.samples import Prompt, Sample


@dataclass(frozen=True)
class Batch:
    """B sequences ready for the loss. ``behaviour_logprobs[b]`` has one entry per completion token."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]
    advantages: list[float]
    rewards: list[float]
    versions: list[str]


def rollout_batch(
    candidate: CandidateConfig,
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[list[int]],
    groups: Sequence[Sequence[Sample]],
    reward: RewardMix,
    extra_metadata_PG: Sequence[Sequence[dict]] | None = None,
) -> tuple[Batch, dict[str, float]]:
    """Score rollout groups (``P`` prompts x ``G`` samples) and compute advantages.

    ``extra_metadata_PG[p][g]`` is merged into prompt ``p``'s metadata when scoring
    sample ``g`` (e.g. ``reward_model_score``, the reward model's score of that sample).
    """
    extra = extra_metadata_PG or [[{}] * len(group) for group in groups]
    rewards_PG = torch.tensor(
        [[reward(p.messages, s.text, {**p.metadata, **x}) for s, x in zip(group, xs)] for p, group, xs in zip(prompts, groups, extra)],
        dtype=torch.float64,
    )
    if candidate.algorithm == "grpo":
        advantages_PG = group_advantages(rewards_PG)
    else:  # ppo_clip without a value model: the group mean is the baseline
        advantages_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
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


def offline_batch(
    prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]], base: ResidentBase, reward: RewardMix
) -> tuple[Batch, dict[str, float]]:
    """Logged rows as a batch. Rows without logged token ids are tokenised;
    rows without logged log-probs use the base model's (the reference) as the
    behaviour policy, which is exact when the base served them. Each completion
    is cut to fit ``max_seq_len`` after its prompt (its logged log-probs too).

    Raises:
        DataError: a row has no logged completion or no logged reward.
    """
    bad = [p.prompt_id for p in prompts if p.logged_completion is None or p.logged_reward is None]
    if bad:
        raise DataError(f"offline rows need a logged completion and reward; rows {bad[:5]} lack one: filter them out first")
    # Logged ids the base cannot embed are replaced by the tokenised text; their logprobs then no longer apply.
    completions = [base.completion_ids(p.logged_completion, p.logged_token_ids) for p in prompts]
    behaviour: list[list[float] | None] = [
        list(p.logged_logprobs)
        if p.logged_logprobs and len(p.logged_logprobs) == len(c) and (not p.logged_token_ids or c == list(p.logged_token_ids))
        else None
        for p, c in zip(prompts, completions)
    ]
    # Cut each completion (and its logged log-probs) to fit max_seq_len after its prompt: a logged completion from
    # traffic can be ~250k tokens within kafka.max_record_bytes, and the update runs the model over all of it.
    for i, ids in enumerate(prompt_ids):
        room = max(1, base.max_seq_len - len(ids))
        completions[i] = completions[i][:room]
        behaviour[i] = behaviour[i][:room] if behaviour[i] is not None else None
    missing = [i for i, b in enumerate(behaviour) if b is None]
    if missing:
        with torch.no_grad(), base.reference():
            ref_BT, _ = base.completion_logprobs([prompt_ids[i] for i in missing], [completions[i] for i in missing])
        for row, i in enumerate(missing):
            behaviour[i] = ref_BT[row, : len(completions[i])].tolist()
    rewards_B = torch.tensor(
        [reward(p.messages, p.logged_completion or "", {**p.metadata, "reward": p.logged_reward}) for p in prompts], dtype=torch.float64
    )
    advantages_B = (rewards_B - rewards_B.mean()) / (rewards_B.std(unbiased=False) + 1e-6)
    batch = Batch(
        prompt_ids=[list(ids) for ids in prompt_ids],
        completion_ids=completions,
        behaviour_logprobs=[b or [] for b in behaviour],
        advantages=advantages_B.tolist(),
        rewards=rewards_B.tolist(),
        versions=[p.logged_adapter_version or "base" for p in prompts],
    )
    metrics = {
        "train/reward_mean": rewards_B.mean().item(),
        "train/reward_std": rewards_B.std(unbiased=False).item(),
        "train/behaviour_from_reference": len(missing) / max(1, len(prompts)),
    }
    return batch, metrics


def _pad(rows: Sequence[Sequence[float]], T: int, device: torch.device) -> torch.Tensor:
    out_BT = torch.zeros((len(rows), T), dtype=torch.float32)
    for b, row in enumerate(rows):
        out_BT[b, : len(row)] = torch.tensor(list(row)[:T], dtype=torch.float32)
    return out_BT.to(device)


def update_step(
    base: ResidentBase, optimizer: torch.optim.Optimizer, candidate: CandidateConfig, rl: RLConfig, batch: Batch
) -> dict[str, float]:
    """One AdamW step on the live adapter: loss = policy loss + kl_coef * k3 KL.

    The adapter being trained must be live (the store's ``activate``), and
    ``optimizer`` its optimizer. Returns ``train/loss``, ``train/pg_loss``,
    ``train/kl``, ``train/clip_frac``, ``train/grad_norm``,
    ``train/tokens_per_s`` (completion tokens through forward+backward per
    second of update time), ``train/update_s``.
    """
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    base.model.train()
    with torch.no_grad(), base.reference():
        ref_BT, _ = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
    logprobs_BT, mask_BT = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
    old_BT = _pad(batch.behaviour_logprobs, logprobs_BT.shape[1], base.device)
    advantages_B = torch.tensor(batch.advantages, dtype=torch.float32, device=base.device)
    if candidate.algorithm == "offline_is":
        pg_loss, clip_frac = importance_weighted_pg_loss(logprobs_BT, old_BT, advantages_B, mask_BT)
    else:
        pg_loss, clip_frac = ppo_clip_loss(logprobs_BT, old_BT, advantages_B, mask_BT, rl.clip_eps)
    kl = masked_mean(kl_k3(logprobs_BT, ref_BT), mask_BT)
    loss = pg_loss + candidate.kl_coef * kl
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, rl.max_grad_norm).item()  # CPU-GPU sync point
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - started
    tokens = float(mask_BT.sum().item())
    return {
        "train/loss": loss.item(),
        "train/pg_loss": pg_loss.item(),
        "train/kl": kl.item(),
        "train/clip_frac": clip_frac.item(),
        "train/grad_norm": grad_norm,
        "train/tokens_per_s": tokens / max(elapsed, 1e-9),
        "train/update_s": elapsed,
        "train/skipped_nonfinite": float(not math.isfinite(grad_norm)),
    }
