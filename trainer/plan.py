"""The plan of a round, built once before any training: per candidate its config, its
algorithm (:data:`trainer.algorithms.registry.ALGORITHMS`), its training reward mix, its prompt pool and
its start point, and one cache of the prompts' token ids for the whole round.

:func:`plan_round` sets aside a candidate with nothing to learn from this window (an empty pool: it sits the
round out, named with the reason in ``RoundPlan.skipped``) and refuses a round where no candidate is left,
before any training.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainer.model.base import ResidentBase
from trainer.config import CandidateConfig, RLConfig, UpdateMode
from trainer.errors import NotEnoughDataError
from trainer.multi_lora.one_pass import one_pass_ok
from trainer.rewards import RewardMix, build_reward
from trainer.types import Prompt
from trainer.algorithms.registry import ALGORITHMS, AlgorithmSpec


class PromptTokens:
    """Each prompt's token ids (the logged ``prompt_token_ids`` as vLLM served them where the row has them, else
    the chat template with the tools offered: :meth:`ResidentBase.prompt_ids`; the oldest tokens cut so
    ``rl.rollout.max_new_tokens`` still fit in ``base.max_seq_len``), built once per round however often a
    step uses the prompt.
    The returned lists are shared: callers copy before changing them."""

    def __init__(self, base: ResidentBase, rl: RLConfig) -> None:
        self._base = base
        self._keep = max(1, base.max_seq_len - rl.rollout.max_new_tokens)
        self._ids: dict[int, tuple[Prompt, list[int]]] = {}  # id(prompt) -> (prompt, its ids); the prompt is kept alive

    def __call__(self, prompt: Prompt) -> list[int]:
        hit = self._ids.get(id(prompt))
        if hit is None:
            ids = self._base.prompt_ids(prompt.messages, prompt.tools, prompt.logged_prompt_token_ids)
            hit = (prompt, ids[-self._keep :])
            self._ids[id(prompt)] = hit
        return hit[1]

    def many(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        return [self(p) for p in prompts]


@dataclass(frozen=True)
class CandidatePlan:
    """What one candidate learns from this round: its config, its algorithm (:data:`trainer.algorithms.registry.ALGORITHMS`),
    its training reward mix, its prompt pool (online: prompts to roll out; offline: logged rows its algorithm
    can use) and where it starts (None: fresh)."""

    config: CandidateConfig
    algorithm: AlgorithmSpec
    reward: RewardMix
    pool: tuple[Prompt, ...]
    start: Path | None

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True)
class RoundPlan:
    """Every candidate's plan, in config order, and the round's prompt-token cache (also used by the
    round's evaluation); ``skipped``: the candidates with nothing to learn from this window -> why."""

    candidates: tuple[CandidatePlan, ...]
    tokens: PromptTokens
    skipped: Mapping[str, str] = field(default_factory=dict)

    @property
    def online(self) -> list[CandidatePlan]:
        return [c for c in self.candidates if c.algorithm.online]

    def one_pass(self, rl: RLConfig) -> set[str]:
        """Candidates that update together (``rl.update.mode = "one_pass"``, linear LoRA targets only, the base
        as reference)."""
        return {
            c.name
            for c in self.candidates
            if rl.update.mode == UpdateMode.ONE_PASS
            and c.algorithm.one_pass
            and one_pass_ok(c.config)
            and c.config.reference == "base"  # one forward's reference pass is the base's, shared by all members
        }


def plan_round(
    base: ResidentBase,
    candidates: Sequence[CandidateConfig],
    rl: RLConfig,
    train_prompts: Sequence[Prompt],
    champions: Mapping[str, Path | None],
    out_dir: Path,
) -> RoundPlan:
    """Each candidate's plan (see :class:`CandidatePlan`). A pool keeps the prompts that pass the
    candidate's ``data_filter`` and that its reward mix can score (e.g. ``exact_answer`` needs
    ``metadata["reference_answer"]``); an offline algorithm's pool keeps the rows it can use. A candidate
    whose pool is empty sits the round out (``RoundPlan.skipped``, with why); the others train.

    Raises:
        NotEnoughDataError: no candidate has a training prompt (or, offline, a usable logged row).
    """
    plans = []
    for c in candidates:
        reward = build_reward(c.reward)
        pool = [p for p in train_prompts if reward.accepts(p.metadata)]
        if c.data_filter is not None:
            pool = [p for p in pool if any(c.data_filter in m["content"] for m in p.messages)]
        plan = CandidatePlan(c, ALGORITHMS[c.algorithm], reward, tuple(pool), start_dir(c, champions, out_dir))
        plans.append(plan if plan.algorithm.online or not plan.pool else _offline_rows(plan))
    skipped = {c.name: _NO_PROMPTS if c.algorithm.online else _NO_ROWS for c in plans if not c.pool}
    if plans and len(skipped) == len(plans):
        online = [c.name for c in plans if c.algorithm.online]
        offline = [c.name for c in plans if not c.algorithm.online]
        raise NotEnoughDataError(
            "; ".join(
                [f"candidates {online} have {_NO_PROMPTS}"] * bool(online)
                + [f"offline candidates {offline} have {_NO_ROWS}"] * bool(offline)
            )
        )
    return RoundPlan(tuple(c for c in plans if c.pool), PromptTokens(base, rl), skipped)


_NO_PROMPTS = (
    "no training prompts after the data_filter and the reward mix's metadata needs (exact_answer needs "
    "metadata.reference_answer); loosen the filter, widen the window, or change the reward"
)
_NO_ROWS = (
    "no logged rows with completion and reward (or correction) in the training window (for kto_desirable_from = "
    "'explicit': none but positive labels from implicit signals alone)"
)


def _offline_rows(plan: CandidatePlan) -> CandidatePlan:
    """The plan with the logged rows its algorithm can use, and its config for those rows (KTO's class weights)."""
    rows = tuple(p for p in plan.pool if plan.algorithm.usable_row(p, plan.config))
    config = plan.algorithm.for_rows(plan.config, rows, plan.reward) if rows else plan.config
    return CandidatePlan(config, plan.algorithm, plan.reward, rows, plan.start)


def start_dir(candidate: CandidateConfig, champions: Mapping[str, Path | None], out_dir: Path) -> Path | None:
    """Where a candidate starts (see the module docstring); None = fresh."""
    if candidate.start == "champion":
        champion = champions.get(candidate.served_model)
        return Path(champion) if champion else None
    if candidate.start == "self":
        last = out_dir.parent / "last" / candidate.name
        return last if (last / "adapter_model.safetensors").is_file() else None
    return None


def draw_prompts(pool: Sequence[Prompt], k: int, seed: int) -> list[Prompt]:
    """``k`` prompts from ``pool`` (with replacement only when the pool is smaller)."""
    rng = random.Random(seed)
    return rng.sample(list(pool), k) if len(pool) >= k else [rng.choice(list(pool)) for _ in range(k)]
