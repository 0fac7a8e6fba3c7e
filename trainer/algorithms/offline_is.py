"""Offline importance-weighted policy gradient on logged rows: the logged completion, its logged log-probs (or
the base's, the reference) and its reward -> advantages (reward minus the batch mean, over the batch std) ->
truncated importance-weighted PG (Ionides 2008; V-trace's rho-bar, Espeholt et al. 2018)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trainer.algorithms.batch import Batch, LossInputs, logged_ids, logged_text, pad_rows
from trainer.algorithms.losses import importance_weighted_pg_loss
from trainer.errors import DataError
from trainer.model.base import ResidentBase
from trainer.rewards import RewardMix
from trainer.types import Prompt


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
        raise DataError(
            f"offline rows need a logged completion and reward; rows {bad[:5]} lack one: filter them out first"
        )
    # Logged ids the base cannot embed are replaced by the tokenised text; their logprobs then no longer apply.
    completions = [logged_ids(base, p) for p in prompts]
    behaviour: list[list[float] | None] = [
        list(p.logged_logprobs)
        if p.logged_logprobs
        and len(p.logged_logprobs) == len(c)
        and (not p.logged_token_ids or c == list(p.logged_token_ids))
        else None
        for p, c in zip(prompts, completions)
    ]
    # Cut each completion (and its logged log-probs) to fit max_seq_len after its prompt: a logged completion from
    # traffic can be ~250k tokens within kafka.max_record_bytes, and the update runs the model over all of it.
    for i, ids in enumerate(prompt_ids):
        room = max(1, base.max_seq_len - len(ids))
        completions[i] = completions[i][:room]
        logged = behaviour[i]
        behaviour[i] = logged[:room] if logged is not None else None
    missing = [i for i, b in enumerate(behaviour) if b is None]
    if missing:
        with torch.no_grad(), base.reference():
            ref_BT, _ = base.completion_logprobs([prompt_ids[i] for i in missing], [completions[i] for i in missing])
        for row, i in enumerate(missing):
            behaviour[i] = ref_BT[row, : len(completions[i])].tolist()
    rewards_B = torch.tensor(
        [reward(p.messages, logged_text(p), {**p.metadata, "reward": p.logged_reward}) for p in prompts],
        dtype=torch.float64,
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


def offline_is_loss(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    old_BT = pad_rows(x.batch.behaviour_logprobs, x.logprobs_BT.shape[1], x.base.device)
    advantages_B = torch.tensor(x.batch.advantages, dtype=torch.float32, device=x.base.device)
    loss, clip_frac = importance_weighted_pg_loss(x.logprobs_BT, old_BT, advantages_B, x.mask_BT)
    return loss, {"train/clip_frac": clip_frac.item()}


def logged_with_reward(p: Prompt, candidate: object) -> bool:
    """A row offline learning can use: a logged completion and its finite reward (a NaN in the snapshot's nullable
    reward column is no label, as for the reward model)."""
    return p.logged_completion is not None and p.logged_reward is not None and math.isfinite(p.logged_reward)
