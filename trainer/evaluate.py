"""Held-out evaluation and the promotion gate.

Every candidate and its tenant's champion (or the base when there is none)
answer the same held-out prompts greedily. Each candidate is scored with its
own reward mix (``logged`` terms dropped: new completions have no logged
reward; a mix with nothing left falls back to ``exact_answer``), and the
champion's completions are scored with the same mix, so every comparison is
paired. The gate per tenant (served model) promotes the candidate with the
highest paired-bootstrap lower confidence bound on (candidate - champion)
reward, if that bound exceeds ``gate_margin`` and its guardrails hold: mean
k3 KL to the base <= ``max_kl``, mean completion length <= ``max_mean_length``
tokens, no NaN. Source of the bound: Efron & Tibshirani 1993, "An
Introduction to the Bootstrap" (percentile interval of a paired mean).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.base import ResidentBase
from trainer.config import CandidateConfig, RewardTerm, RLConfig
from trainer.losses import kl_k3
from trainer.rewards import RewardMix, build_reward
from trainer.rollout import RolloutEngine, RolloutRequest
from trainer.samples import Prompt, Sample
from trainer.types import GateDecision


@dataclass(frozen=True)
class EvalResult:
    """One policy's held-out answers and scores (aligned with the prompts)."""

    version: str
    samples: tuple[Sample, ...]
    rewards: tuple[float, ...]
    mean_kl: float
    mean_length: float

    @property
    def reward_mean(self) -> float:
        return float(np.mean(self.rewards)) if self.rewards else float("nan")


def eval_mix(candidate: CandidateConfig) -> RewardMix:
    """The candidate's reward mix without ``logged`` terms (``exact_answer`` if nothing remains)."""
    mix = build_reward(candidate.reward, skip_logged=True)
    return mix if mix else build_reward([RewardTerm(fn="exact_answer")])


def greedy_answers(
    engine: RolloutEngine, versions: Sequence[str], prompts: Sequence[Prompt], prompt_ids: Sequence[list[int]], rl: RLConfig
) -> dict[str, list[Sample]]:
    """Greedy completions of every version on every prompt, in one engine call."""
    requests = [
        RolloutRequest(version=v, prompt_id=p.prompt_id, prompt_token_ids=tuple(ids), n=1, max_new_tokens=rl.max_new_tokens, temperature=0.0, seed=rl.seed)
        for v in versions
        for p, ids in zip(prompts, prompt_ids)
    ]
    groups = engine.generate(requests)
    out: dict[str, list[Sample]] = {v: [] for v in versions}
    for req, group in zip(requests, groups):
        out[req.version].append(group[0])
    return out


@torch.no_grad()
def kl_to_base(base: ResidentBase, prompt_ids: Sequence[list[int]], samples: Sequence[Sample]) -> float:
    """Mean over sequences of the token-mean k3 KL(live adapter || base) on ``samples``.

    The adapter to measure must be live in the store. NaN when any value is NaN.
    """
    completions = [list(s.token_ids) or [base.tokenizer.eos_token_id] for s in samples]
    logprobs_BT, mask_BT = base.completion_logprobs(prompt_ids, completions)
    with base.reference():
        ref_BT, _ = base.completion_logprobs(prompt_ids, completions)
    kl_B = (kl_k3(logprobs_BT, ref_BT) * mask_BT).sum(1) / mask_BT.sum(1).clamp(min=1)
    return float(kl_B.mean())


def score(samples: Sequence[Sample], prompts: Sequence[Prompt], mix: RewardMix) -> tuple[float, ...]:
    """Reward of each sample under ``mix`` (NaN kept, for the guardrail)."""
    return tuple(float(mix(p.messages, s.text, p.metadata)) for p, s in zip(prompts, samples))


def paired_bootstrap_lower_bound(diffs_N: Sequence[float], confidence: float, resamples: int, seed: int = 0) -> float:
    """Lower ``confidence`` percentile bound of mean(diffs) by the paired bootstrap.

    ``diffs_N[i]`` = candidate reward - champion reward on prompt ``i``.
    NaN when any difference is NaN or there are none.
    """
    diffs = np.asarray(diffs_N, dtype=np.float64)
    if diffs.size == 0 or np.isnan(diffs).any():
        return float("nan")
    rng = np.random.default_rng(seed)
    means = diffs[rng.integers(0, diffs.size, size=(resamples, diffs.size))].mean(axis=1)
    return float(np.quantile(means, 1.0 - confidence))


def gate(
    served_model: str,
    candidates: Sequence[CandidateConfig],
    results: dict[str, EvalResult],
    champion_rewards: dict[str, tuple[float, ...]],
    champion_label: str,
    rl: RLConfig,
) -> GateDecision:
    """The verdict for one tenant (see the module docstring for the rule).

    ``champion_rewards[name]`` are the champion's rewards under candidate
    ``name``'s mix. ``reason`` lists, for every candidate, why it won or lost.
    """
    means = {c.name: results[c.name].reward_mean for c in candidates}
    bounds: dict[str, float] = {}
    verdicts: list[str] = []
    eligible: list[str] = []
    for c in candidates:
        r = results[c.name]
        diffs = [a - b for a, b in zip(r.rewards, champion_rewards[c.name])]
        lb = paired_bootstrap_lower_bound(diffs, rl.gate_confidence, rl.bootstrap_samples, rl.seed)
        bounds[c.name] = lb
        if any(math.isnan(x) for x in (*r.rewards, r.mean_kl, r.mean_length)):
            verdicts.append(f"{c.name}: NaN in rewards, KL or length")
        elif r.mean_kl > rl.max_kl:
            verdicts.append(f"{c.name}: mean KL to base {r.mean_kl:.3f} > max_kl {rl.max_kl}")
        elif r.mean_length > rl.max_mean_length:
            verdicts.append(f"{c.name}: mean length {r.mean_length:.1f} tokens > max_mean_length {rl.max_mean_length}")
        elif not lb > rl.gate_margin:
            verdicts.append(
                f"{c.name}: reward {means[c.name]:.3f} vs {champion_label} {np.mean(champion_rewards[c.name]):.3f}, "
                f"{rl.gate_confidence:.0%} lower bound {lb:+.3f} does not exceed margin {rl.gate_margin}"
            )
        else:
            eligible.append(c.name)
            verdicts.append(f"{c.name}: beats {champion_label} by lower bound {lb:+.3f} > margin {rl.gate_margin}")
    winner = max(eligible, key=lambda n: (bounds[n], means[n])) if eligible else None
    head = f"promote {winner}" if winner else f"keep {champion_label}: no candidate passed"
    first = candidates[0].name if candidates else None
    return GateDecision(
        served_model=served_model,
        winner=winner,
        reason=f"{head}. " + "; ".join(verdicts),
        champion_reward_mean=float(np.mean(champion_rewards[first])) if first else float("nan"),
        candidate_reward_means=means,
        lower_bounds=bounds,
    )
