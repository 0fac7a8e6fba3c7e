"""The algorithms by name (``CandidateConfig.algorithm``): each :class:`~trainer.config.Algorithm` with its
traits (:data:`trainer.config.ALGORITHM_TRAITS`), its batch builder, its policy loss and the logged rows it can
use. Nothing else compares algorithm names, so a new algorithm is one module and one entry here:

- ``grpo`` / ``ppo_clip``: :mod:`trainer.algorithms.ppo`;
- ``offline_is``: :mod:`trainer.algorithms.offline_is`;
- ``kto``: :mod:`trainer.algorithms.kto`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trainer.algorithms.batch import Batch, PolicyLoss, StepData
from trainer.algorithms.kto import balanced, kto_batch, kto_policy_loss, kto_row
from trainer.algorithms.losses import group_advantages
from trainer.algorithms.offline_is import logged_with_reward, offline_batch, offline_is_loss
from trainer.algorithms.ppo import mean_baseline, ppo_loss, rollout_builder
from trainer.config import ALGORITHM_TRAITS, Algorithm, AlgorithmTraits, CandidateConfig
from trainer.rewards import RewardMix
from trainer.types import Prompt


@dataclass(frozen=True)
class AlgorithmSpec:
    """How an algorithm learns: its ``traits`` (online ones get fresh rollouts each step; offline ones draw
    logged rows that ``usable_row`` accepts; one-pass ones may update together in one forward/backward,
    :func:`trainer.multi_lora.one_pass.update_step_one_pass`), ``build_batch`` and ``policy_loss``."""

    traits: AlgorithmTraits
    build_batch: Callable[[StepData], tuple[Batch, dict[str, float]]]
    policy_loss: PolicyLoss
    usable_row: Callable[[Prompt, CandidateConfig], bool]
    for_rows: Callable[[CandidateConfig, Sequence[Prompt], RewardMix], CandidateConfig] = lambda c, rows, reward: c
    """The candidate's config for this round's usable rows (offline algorithms; as configured, but KTO's
    :func:`~trainer.algorithms.kto.balanced` class weights)."""

    @property
    def online(self) -> bool:
        return self.traits.online

    @property
    def one_pass(self) -> bool:
        return self.traits.one_pass


def _any_row(p: Prompt, candidate: CandidateConfig) -> bool:
    return True


ALGORITHMS: dict[Algorithm, AlgorithmSpec] = {
    Algorithm.GRPO: AlgorithmSpec(
        ALGORITHM_TRAITS[Algorithm.GRPO], rollout_builder(group_advantages), ppo_loss, _any_row
    ),
    Algorithm.PPO_CLIP: AlgorithmSpec(
        ALGORITHM_TRAITS[Algorithm.PPO_CLIP], rollout_builder(mean_baseline), ppo_loss, _any_row
    ),
    Algorithm.OFFLINE_IS: AlgorithmSpec(
        ALGORITHM_TRAITS[Algorithm.OFFLINE_IS],
        lambda d: offline_batch(d.prompts, d.prompt_ids, d.base, d.reward),
        offline_is_loss,
        logged_with_reward,
    ),
    Algorithm.KTO: AlgorithmSpec(
        ALGORITHM_TRAITS[Algorithm.KTO],
        lambda d: kto_batch(d.candidate, d.prompts, d.prompt_ids, d.base, d.reward),
        kto_policy_loss,
        kto_row,
        balanced,
    ),
}

ONE_PASS_ALGORITHMS = frozenset(a for a, spec in ALGORITHMS.items() if spec.one_pass)
"""Algorithms that may update together in one forward/backward (:mod:`trainer.multi_lora.one_pass`): their loss must
be a token mean over the batch (plus the token-mean KL), so that it splits over chunks of rows."""
