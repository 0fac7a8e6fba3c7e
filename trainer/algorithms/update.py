"""One optimizer step of one candidate: build the batch, score it, update.

:data:`ALGORITHMS` maps every :class:`~trainer.config.Algorithm` to its
:class:`AlgorithmSpec` (online or offline, which logged rows it can use, its
batch builder, its policy loss, whether it joins one-pass updates); nothing
else compares algorithm names, so a new algorithm is one entry:

- ``grpo`` / ``ppo_clip``: :func:`rollout_batch`, rollout groups -> rewards ->
  advantages (``grpo``: group-normalised, Shao et al. 2024; ``ppo_clip``:
  reward minus the group mean, no std scaling); PPO-clip loss.
- ``offline_is``: :func:`offline_batch`, logged rows (completion, logged
  log-probs, reward) -> advantages (reward minus the batch mean, over the batch
  std); truncated importance-weighted PG.
- ``kto``: :func:`kto_batch`, logged rows -> desirable / undesirable examples
  (reward mix > 0; a user correction is one more desirable example); the KTO
  loss (Ethayarajh et al. 2024) against the base with adapters disabled.

:func:`update_step` adds ``kl_coef`` * k3 KL to the reference (the base with
adapters disabled) to the policy loss, then backward, clip, AdamW step.
Each function returns its result and a metrics dict with namespaced keys.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trainer.model.base import ResidentBase
from trainer.config import Algorithm, CandidateConfig, RLConfig
from trainer.errors import DataError
from trainer.algorithms.losses import (
    group_advantages,
    importance_weighted_pg_loss,
    kl_k3,
    kto_loss,
    masked_mean,
    ppo_clip_loss,
    sequence_logprobs,
)
from trainer.timers import phase
from trainer.rewards import RewardMix
from trainer.types import Prompt, Sample


@dataclass(frozen=True)
class Batch:
    """B sequences ready for the loss. ``behaviour_logprobs[b]`` has one entry per completion token
    (empty for ``kto``, which needs none); ``desirable[b]`` is the KTO label (None for other algorithms)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]
    advantages: list[float]
    rewards: list[float]
    versions: list[str]
    desirable: list[bool] | None = None


Advantages = Callable[[torch.Tensor], torch.Tensor]
"""Rewards ``rewards_PG`` (``P`` prompts x ``G`` samples) -> advantages of the same shape."""


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


def fit_after(base: ResidentBase, prompt_ids: Sequence[int], completion_ids: list[int]) -> list[int]:
    """``completion_ids`` cut to fit ``base.max_seq_len`` after the prompt (at least one token): a logged
    completion or a correction from traffic can be far longer than the model's window."""
    return completion_ids[: max(1, base.max_seq_len - len(prompt_ids))]


def logged_ids(base: ResidentBase, p: Prompt) -> list[int]:
    """The logged completion's token ids: the logged ids when the base can embed every one, else the text
    tokenised (see :meth:`ResidentBase.completion_ids`); EOS for an empty completion."""
    return base.completion_ids(p.logged_completion or "", p.logged_token_ids) or [base.tokenizer.eos_token_id]


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
        [reward(p.messages, p.logged_completion or "", {**p.metadata, "reward": p.logged_reward}) for p in prompts],
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


def kto_batch(
    candidate: CandidateConfig,
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[list[int]],
    base: ResidentBase,
    reward: RewardMix,
) -> tuple[Batch, dict[str, float]]:
    """Logged rows as KTO examples: the logged completion, desirable when the reward mix
    (e.g. ``logged``: the buffer's reward from the user's feedback) is > 0; and, with
    ``candidate.kto_use_corrections``, the user's correction as one more desirable example.

    Raises:
        DataError: a row has neither a logged completion with a reward nor a usable correction.
    """
    ids: list[list[int]] = []
    completions: list[list[int]] = []
    desirable: list[bool] = []
    rewards: list[float] = []
    versions: list[str] = []
    corrections = 0
    for p, pids in zip(prompts, prompt_ids):
        used = False
        if p.logged_completion is not None and p.logged_reward is not None:
            value = reward(p.messages, p.logged_completion, {**p.metadata, "reward": p.logged_reward})
            ids.append(list(pids))
            completions.append(fit_after(base, pids, logged_ids(base, p)))
            desirable.append(value > 0)
            rewards.append(value)
            versions.append(p.logged_adapter_version or "base")
            used = True
        if candidate.kto_use_corrections and p.logged_correction:
            ids.append(list(pids))
            correction = base.tokenizer(p.logged_correction, add_special_tokens=False)["input_ids"] or [
                base.tokenizer.eos_token_id
            ]
            completions.append(fit_after(base, pids, correction))
            desirable.append(True)
            versions.append("correction")
            corrections += 1
            used = True
        if not used:
            raise DataError(
                f"kto row {p.prompt_id!r} has no logged completion with a reward and no correction: filter it out first"
            )
    rewards_t = torch.tensor(rewards or [float("nan")], dtype=torch.float64)
    batch = Batch(
        prompt_ids=ids,
        completion_ids=completions,
        behaviour_logprobs=[[] for _ in ids],
        advantages=[1.0 if d else -1.0 for d in desirable],
        rewards=rewards,
        versions=versions,
        desirable=desirable,
    )
    metrics = {
        "train/reward_mean": rewards_t.mean().item(),
        "train/kto_desirable_frac": sum(desirable) / len(desirable),
        "train/kto_corrections": float(corrections),
    }
    return batch, metrics


def _pad(rows: Sequence[Sequence[float]], T: int, device: torch.device) -> torch.Tensor:
    out_BT = torch.zeros((len(rows), T), dtype=torch.float32)
    for b, row in enumerate(rows):
        out_BT[b, : len(row)] = torch.tensor(list(row)[:T], dtype=torch.float32)
    return out_BT.to(device)


# --- the algorithm registry ---------------------------------------------------------------


@dataclass(frozen=True)
class StepData:
    """What one candidate learns from in one step: the step's prompts (online: with their rollout
    ``groups``, ``P`` prompts x ``G`` samples) or logged rows (offline: ``groups`` is None)."""

    candidate: CandidateConfig
    prompts: Sequence[Prompt]
    prompt_ids: Sequence[list[int]]
    groups: Sequence[Sequence[Sample]] | None
    base: ResidentBase
    reward: RewardMix
    extra_metadata_PG: Sequence[Sequence[dict]] | None = (
        None  # online: per-sample metadata for the reward (e.g. reward_model_score)
    )


@dataclass(frozen=True)
class LossInputs:
    """The policy loss's inputs: log-probs of the batch's completion tokens under the live adapter
    (``logprobs_BT``, with grad) and the reference (``ref_BT``), and the mask ``mask_BT``."""

    base: ResidentBase
    candidate: CandidateConfig
    rl: RLConfig
    batch: Batch
    logprobs_BT: torch.Tensor
    ref_BT: torch.Tensor
    mask_BT: torch.Tensor


PolicyLoss = Callable[[LossInputs], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class AlgorithmSpec:
    """How an algorithm learns: ``online`` ones get fresh rollouts each step; offline ones draw
    logged rows that ``usable_row`` accepts. ``build_batch`` and ``policy_loss`` do the rest;
    ``one_pass`` ones may update together in one forward/backward (:func:`trainer.multi_lora.one_pass.update_step_one_pass`;
    their policy loss and its metrics must be token means over the batch, which split over chunks of rows)."""

    online: bool
    build_batch: Callable[[StepData], tuple[Batch, dict[str, float]]]
    policy_loss: PolicyLoss
    usable_row: Callable[[Prompt, CandidateConfig], bool]
    one_pass: bool = False


def _ppo_loss(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    old_BT = _pad(x.batch.behaviour_logprobs, x.logprobs_BT.shape[1], x.base.device)
    advantages_B = torch.tensor(x.batch.advantages, dtype=torch.float32, device=x.base.device)
    loss, clip_frac = ppo_clip_loss(x.logprobs_BT, old_BT, advantages_B, x.mask_BT, x.rl.clip_eps)
    return loss, {"train/clip_frac": clip_frac.item()}


def _offline_is_loss(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    old_BT = _pad(x.batch.behaviour_logprobs, x.logprobs_BT.shape[1], x.base.device)
    advantages_B = torch.tensor(x.batch.advantages, dtype=torch.float32, device=x.base.device)
    loss, clip_frac = importance_weighted_pg_loss(x.logprobs_BT, old_BT, advantages_B, x.mask_BT)
    return loss, {"train/clip_frac": clip_frac.item()}


def _kto_loss(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """KTO on the batch; the KL reference point uses the batch's completions shifted by one (as TRL)."""
    batch = x.batch
    shifted = [batch.completion_ids[-1], *batch.completion_ids[:-1]]
    with torch.no_grad():
        kl_BT, kl_mask_BT = x.base.completion_logprobs(batch.prompt_ids, shifted)
        with x.base.reference():
            ref_kl_BT, _ = x.base.completion_logprobs(batch.prompt_ids, shifted)
    desirable_B = torch.tensor(batch.desirable or [], dtype=torch.bool, device=x.base.device)
    policy_B = sequence_logprobs(x.logprobs_BT, x.mask_BT)
    reference_B = sequence_logprobs(x.ref_BT, x.mask_BT)
    loss, z0 = kto_loss(
        policy_B,
        reference_B,
        desirable_B,
        sequence_logprobs(kl_BT, kl_mask_BT),
        sequence_logprobs(ref_kl_BT, kl_mask_BT),
        beta=x.candidate.kto_beta,
        desirable_weight=x.candidate.kto_desirable_weight,
        undesirable_weight=x.candidate.kto_undesirable_weight,
    )
    margin_B = (policy_B - reference_B).detach()
    metrics = {"train/kto_z0": z0.item()}
    if desirable_B.any():
        metrics["train/kto_logratio_desirable"] = margin_B[desirable_B].mean().item()
    if (~desirable_B).any():
        metrics["train/kto_logratio_undesirable"] = margin_B[~desirable_B].mean().item()
    return loss, metrics


def _rollout(advantages: Advantages) -> Callable[[StepData], tuple[Batch, dict[str, float]]]:
    def build(data: StepData) -> tuple[Batch, dict[str, float]]:
        if data.groups is None:
            raise DataError(f"candidate {data.candidate.name!r} ({data.candidate.algorithm}) needs rollout groups")
        return rollout_batch(
            data.prompts, data.prompt_ids, data.groups, data.reward, advantages, data.extra_metadata_PG
        )

    return build


def _any_row(p: Prompt, candidate: CandidateConfig) -> bool:
    return True


def _logged_with_reward(p: Prompt, candidate: CandidateConfig) -> bool:
    return p.logged_completion is not None and p.logged_reward is not None


def _kto_row(p: Prompt, candidate: CandidateConfig) -> bool:
    return _logged_with_reward(p, candidate) or bool(candidate.kto_use_corrections and p.logged_correction)


ALGORITHMS: dict[Algorithm, AlgorithmSpec] = {
    Algorithm.GRPO: AlgorithmSpec(
        online=True, build_batch=_rollout(group_advantages), policy_loss=_ppo_loss, usable_row=_any_row, one_pass=True
    ),
    Algorithm.PPO_CLIP: AlgorithmSpec(
        online=True, build_batch=_rollout(mean_baseline), policy_loss=_ppo_loss, usable_row=_any_row, one_pass=True
    ),
    Algorithm.OFFLINE_IS: AlgorithmSpec(
        online=False,
        build_batch=lambda d: offline_batch(d.prompts, d.prompt_ids, d.base, d.reward),
        policy_loss=_offline_is_loss,
        usable_row=_logged_with_reward,
    ),
    Algorithm.KTO: AlgorithmSpec(
        online=False,
        build_batch=lambda d: kto_batch(d.candidate, d.prompts, d.prompt_ids, d.base, d.reward),
        policy_loss=_kto_loss,
        usable_row=_kto_row,
    ),
}


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
        spec = ALGORITHMS[candidate.algorithm]
        pg_loss, loss_metrics = spec.policy_loss(LossInputs(base, candidate, rl, batch, logprobs_BT, ref_BT, mask_BT))
        kl = masked_mean(kl_k3(logprobs_BT, ref_BT), mask_BT)
        loss = pg_loss + candidate.kl_coef * kl
        loss.backward()
    with phase("time/optimizer_s"):
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
        **loss_metrics,
        "train/grad_norm": grad_norm,
        "train/tokens_per_s": tokens / max(elapsed, 1e-9),
        "train/update_s": elapsed,
        "train/skipped_nonfinite": float(not math.isfinite(grad_norm)),
    }


ONE_PASS_ALGORITHMS = frozenset(a for a, spec in ALGORITHMS.items() if spec.one_pass)
"""Algorithms that may update together in one forward/backward (:mod:`trainer.multi_lora.one_pass`): their loss must
be a token mean over the batch (plus the token-mean KL), so that it splits over chunks of rows."""
