"""Held-out evaluation and the promotion gate: one yardstick per served model.

Every candidate and its tenant's champion (or the base when there is none)
are measured on the same held-out rows with the same yardstick,
``rl.gate_metric``, which belongs to the served model and never depends on a
candidate's own training reward:

- ``verifiable``: greedy answers scored by ``rl.gate_reward`` (default
  ``exact_answer``), on held-out rows that carry its metadata (trusted
  reference answers). Value: the mean reward.
- ``reward_model``: greedy answers scored by the round's reward model (trained
  on the training split only). A round without one, or whose reward model's
  held-out AUC lower bound is <= 0.5 (not better than chance), promotes
  nothing. Value: the mean score.
- ``feedback``: on held-out traces with a reward (user feedback), the policy's
  implicit reward ``log pi(y|x) - log pi_ref(y|x)`` (sequence sums; pi_ref =
  the base with adapters disabled) of the logged completion ranks up-voted
  (reward > 0) above down-voted ones. Value: the AUC (Mann-Whitney, ties
  count 1/2); the base as champion has implicit reward 0 and AUC 0.5.

The gate per tenant promotes the candidate with the highest paired-bootstrap
lower confidence bound on (candidate - champion) value - the mean of paired
per-row differences, or for ``feedback`` the AUC difference on the same
resampled rows - if that bound exceeds ``gate_margin`` and its guardrails
hold: mean k3 KL to the base on its greedy answers <= ``max_kl`` (the
serving engine's log-probs against the base's, :func:`kl_to_base`), mean
completion length <= ``max_mean_length`` tokens, no NaN. Source of the bound:
Efron & Tibshirani 1993, "An Introduction to the Bootstrap" (percentile
interval); AUC as the Mann-Whitney statistic: Hanley & McNeil 1982.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.model.base import ResidentBase
from trainer.config import CandidateConfig, RLConfig
from trainer.errors import RolloutError
from trainer.algorithms.losses import kl_k3, sequence_logprobs
from trainer.rewards import RewardMix, build_reward
from trainer.rollout.engine import RolloutEngine, RolloutRequest
from trainer.types import Prompt, Sample
from trainer.types import GateDecision

METRIC_UNITS = {"verifiable": "reward", "reward_model": "reward-model score", "feedback": "feedback AUC"}


@dataclass(frozen=True)
class EvalResult:
    """One policy's held-out answers and values under the gate metric (aligned with the rows).

    ``rewards[i]`` is row ``i``'s value: the gate reward or reward-model score
    of the greedy answer, or (``feedback``) the implicit reward of the logged
    completion. ``value`` is the gate metric's value (the AUC for
    ``feedback``); None means the mean of ``rewards``.
    """

    version: str
    samples: tuple[Sample, ...]
    rewards: tuple[float, ...]
    mean_kl: float
    mean_length: float
    value: float | None = None

    @property
    def reward_mean(self) -> float:
        return float(np.mean(self.rewards)) if self.rewards else float("nan")

    @property
    def metric_value(self) -> float:
        return self.reward_mean if self.value is None else self.value

    def as_metrics(self, metric: str) -> dict[str, float]:
        """``eval/<metric>`` (the gate value), ``eval/reward_mean`` (mean per-row value), ``eval/kl``,
        ``eval/mean_length``; undefined ones (no usable held-out row) are left out, not NaN."""
        out = {
            f"eval/{metric}": self.metric_value,
            "eval/reward_mean": self.reward_mean,
            "eval/kl": self.mean_kl,
            "eval/mean_length": self.mean_length,
        }
        return {k: v for k, v in out.items() if math.isfinite(v)}


def gate_mix(rl: RLConfig) -> RewardMix:
    """The ``verifiable`` yardstick: ``rl.gate_reward``, the same for every candidate and the champion."""
    return build_reward(rl.gate_reward)


def usable_rows(heldout: Sequence[Prompt], rl: RLConfig) -> list[Prompt]:
    """The held-out rows ``rl.gate_metric`` can use, oldest first: ``verifiable``: rows with the gate
    reward's metadata; ``feedback``: rows with a logged completion and reward; ``reward_model``: all."""
    if rl.gate_metric == "verifiable":
        mix = gate_mix(rl)
        return [p for p in heldout if mix.accepts(p.metadata)]
    if rl.gate_metric == "feedback":
        return [p for p in heldout if p.logged_completion is not None and p.logged_reward is not None]
    return list(heldout)


def feedback_labels(rows: Sequence[Prompt]) -> list[bool]:
    """Up-voted (logged reward > 0) or not, per row."""
    return [bool(p.logged_reward is not None and p.logged_reward > 0) for p in rows]


def unusable_reason(rows: Sequence[Prompt], heldout_count: int, rl: RLConfig) -> str | None:
    """Why the held-out rows cannot gate this round (None when they can)."""
    if not rows:
        needs = {
            "verifiable": f"the metadata {sorted(gate_mix(rl).required_metadata)} of rl.gate_reward",
            "feedback": "a logged completion with a reward (user feedback)",
            "reward_model": "a prompt",
        }[rl.gate_metric]
        return f"none of the {heldout_count} held-out rows carries {needs}, which gate metric {rl.gate_metric!r} needs"
    if rl.gate_metric == "feedback":
        labels = feedback_labels(rows)
        if all(labels) or not any(labels):
            kind = "up-voted" if all(labels) else "down-voted"
            return f"all {len(rows)} held-out rows with feedback are {kind}; the feedback AUC needs both up- and down-votes"
    return None


def greedy_answers(
    engine: RolloutEngine,
    versions: Sequence[str],
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[list[int]],
    rl: RLConfig,
) -> dict[str, list[Sample]]:
    """Greedy completions of every version on every prompt, in one engine call."""
    requests = [
        RolloutRequest(
            version=v,
            prompt_id=p.prompt_id,
            prompt_token_ids=tuple(ids),
            n=1,
            max_new_tokens=rl.max_new_tokens,
            temperature=0.0,
            seed=rl.seed,
        )
        for v in versions
        for p, ids in zip(prompts, prompt_ids)
    ]
    groups = engine.generate(requests)
    out: dict[str, list[Sample]] = {v: [] for v in versions}
    for req, group in zip(requests, groups):
        out[req.version].append(group[0])
    return out


EVAL_CHUNK = 16  # sequences per forward pass at evaluation (bounds the [B, T, V] logits)


REFERENCE_CHUNK_ROWS = 64  # answers per reference forward: each prompt's answers together (bounds the [B, T, V] logits)


@torch.no_grad()
def reference_logprobs(
    base: ResidentBase, prompt_ids: Sequence[list[int]], answers: Mapping[str, Sequence[Sample]]
) -> dict[str, list[torch.Tensor | None]]:
    """Log-probs of every version's answers under the base with adapters disabled, in one pass.

    ``answers[v][i]`` is version ``v``'s answer to ``prompt_ids[i]``. Rows are
    ordered by prompt (prompt 0's answers from every version, then prompt 1's,
    ...) and a forward pass holds whole prompts' answers, up to
    ``REFERENCE_CHUNK_ROWS`` rows (more only when one prompt has more answers),
    so each prompt runs once for all versions (:mod:`trainer.model.logprobs`);
    answers without tokens are skipped.

    Returns:
        ``{version: [logprobs_T or None]}`` aligned with ``answers[version]``:
        a float32 CPU tensor of length ``T`` = the answer's token count
        (natural log), None for an answer without tokens.

    Raises:
        ValueError: a version's answers do not match ``prompt_ids`` in number.
    """
    for version, samples in answers.items():
        if len(samples) != len(prompt_ids):
            raise ValueError(f"version {version!r} has {len(samples)} answers for {len(prompt_ids)} prompts")
    out: dict[str, list[torch.Tensor | None]] = {v: [None] * len(prompt_ids) for v in answers}
    chunks: list[list[tuple[str, int]]] = [[]]
    for i in range(len(prompt_ids)):
        rows = [(v, i) for v in answers if answers[v][i].token_ids]
        if chunks[-1] and len(chunks[-1]) + len(rows) > REFERENCE_CHUNK_ROWS:
            chunks.append([])
        chunks[-1].extend(rows)
    for chunk in chunks:
        if not chunk:
            continue
        with base.reference():
            logprobs_BT, _ = base.completion_logprobs(
                [prompt_ids[i] for _, i in chunk], [list(answers[v][i].token_ids) for v, i in chunk]
            )
        logprobs_BT = logprobs_BT.float().cpu()
        for b, (v, i) in enumerate(chunk):
            out[v][i] = logprobs_BT[b, : len(answers[v][i].token_ids)]
    return out


def kl_to_base(samples: Sequence[Sample], reference: Sequence[torch.Tensor | None]) -> float:
    """Mean over sequences of the token-mean k3 KL(policy || base) on ``samples``.

    The policy side is each sample's own ``Sample.logprobs``: the log-probs of
    its tokens under the engine that served it (vLLM, or :class:`~trainer.rollout.hf.HFEngine`),
    so this is the KL of what is actually served. The base side is
    ``reference`` (from :func:`reference_logprobs`, aligned with ``samples``).
    A vLLM CPU engine computes in float32 and the trainer's base may be bf16:
    their difference is numeric noise (for an untrained adapter a mean KL of
    order 1e-4 or less). A sample without tokens has no KL term and is left
    out. Per-token KL: :func:`trainer.algorithms.losses.kl_k3` (Schulman 2020).

    Returns:
        The mean KL (nats); NaN when any value is NaN or no sample has tokens.

    Raises:
        RolloutError: a sample whose log-probs do not match its tokens in
            number (an engine that does not report them).
        ValueError: ``reference`` lacks log-probs of a sample's length.
    """
    kls: list[float] = []
    for s, ref_T in zip(samples, reference, strict=True):
        if not s.token_ids:
            continue
        if len(s.logprobs) != len(s.token_ids):
            raise RolloutError(
                f"answer {s.prompt_id!r} of {s.adapter_version!r} has {len(s.logprobs)} log-probs for "
                f"{len(s.token_ids)} tokens; the evaluation KL needs the engine's log-prob of every token"
            )
        if ref_T is None or ref_T.shape != (len(s.token_ids),):
            shape = None if ref_T is None else tuple(ref_T.shape)
            raise ValueError(
                f"reference log-probs of {s.prompt_id!r} ({s.adapter_version!r}) have shape {shape}, "
                f"expected ({len(s.token_ids)},)"
            )
        kls.append(float(kl_k3(torch.tensor(s.logprobs, dtype=torch.float32), ref_T.float()).mean()))
    return float(np.mean(kls)) if kls else float("nan")


@torch.no_grad()
def sequence_logps(
    base: ResidentBase, prompt_ids: Sequence[list[int]], completion_ids: Sequence[list[int]], *, reference: bool = False
) -> list[float]:
    """log pi(y|x) of each completion (sum over its tokens) under the live adapter, or the base with
    adapters disabled when ``reference``; ``EVAL_CHUNK`` sequences per forward pass."""
    out: list[float] = []
    for i in range(0, len(completion_ids), EVAL_CHUNK):
        ids, comps = prompt_ids[i : i + EVAL_CHUNK], completion_ids[i : i + EVAL_CHUNK]
        with base.reference() if reference else contextlib.nullcontext():
            logprobs_BT, mask_BT = base.completion_logprobs(ids, comps)
        out.extend(sequence_logprobs(logprobs_BT, mask_BT).tolist())
    return out


def score(samples: Sequence[Sample], prompts: Sequence[Prompt], mix: RewardMix) -> tuple[float, ...]:
    """Reward of each sample under ``mix`` (NaN kept, for the guardrail)."""
    return tuple(float(mix(p.messages, s.text, p.metadata)) for p, s in zip(prompts, samples))


def auc(scores_N: Sequence[float], labels_N: Sequence[bool]) -> float:
    """Probability that a random positive row outscores a random negative one (ties count 1/2).

    NaN when a class is missing or a score is NaN.
    """
    scores, labels = np.asarray(scores_N, dtype=np.float64), np.asarray(labels_N, dtype=bool)
    if scores.size == 0 or np.isnan(scores).any() or labels.all() or not labels.any():
        return float("nan")
    pos, neg = scores[labels], scores[~labels]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (pos.size * neg.size))


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


def _pairwise_wins(scores: np.ndarray) -> np.ndarray:
    """``W[i, j]`` = 1 if score i > score j, 1/2 if equal, 0 otherwise (``[N, N]``)."""
    return (scores[:, None] > scores[None, :]) + 0.5 * (scores[:, None] == scores[None, :])


def paired_auc_lower_bound(
    candidate_N: Sequence[float],
    champion_N: Sequence[float],
    labels_N: Sequence[bool],
    confidence: float,
    resamples: int,
    seed: int = 0,
) -> float:
    """Lower ``confidence`` percentile bound of AUC(candidate) - AUC(champion) by the paired bootstrap.

    Each resample draws the held-out rows with replacement (the same rows for
    both policies); resamples without both classes are skipped. NaN when a
    score is NaN, a class is missing, or no resample has both classes.
    """
    cand, champ = np.asarray(candidate_N, dtype=np.float64), np.asarray(champion_N, dtype=np.float64)
    labels = np.asarray(labels_N, dtype=bool)
    if cand.size == 0 or np.isnan(cand).any() or np.isnan(champ).any() or labels.all() or not labels.any():
        return float("nan")
    n = cand.size
    rng = np.random.default_rng(seed)
    counts_RN = np.zeros((resamples, n))
    np.add.at(counts_RN, (np.repeat(np.arange(resamples), n), rng.integers(0, n, size=resamples * n)), 1.0)
    pos_RN, neg_RN = counts_RN * labels, counts_RN * ~labels
    diff_NN = _pairwise_wins(cand) - _pairwise_wins(champ)
    pairs_R = pos_RN.sum(1) * neg_RN.sum(1)
    ok = pairs_R > 0
    if not ok.any():
        return float("nan")
    diffs_R = ((pos_RN @ diff_NN) * neg_RN).sum(1)[ok] / pairs_R[ok]
    return float(np.quantile(diffs_R, 1.0 - confidence))


def gate(
    served_model: str,
    candidates: Sequence[CandidateConfig],
    results: dict[str, EvalResult],
    champion: Sequence[float],
    champion_label: str,
    rl: RLConfig,
    *,
    labels: Sequence[bool] | None = None,
    refusal: str | None = None,
) -> GateDecision:
    """The verdict for one tenant (see the module docstring for the rule).

    ``champion`` holds the champion's per-row values under the same yardstick
    as ``results``; with ``labels`` (the ``feedback`` metric) values are
    compared by AUC, otherwise by mean. ``refusal``: a reason to promote
    nothing this round (no usable rows, reward model at chance). ``reason``
    lists, for every candidate, why it won or lost.
    """
    unit = METRIC_UNITS[rl.gate_metric]
    champion_value = (
        auc(champion, labels) if labels is not None else (float(np.mean(champion)) if len(champion) else float("nan"))
    )
    values = {c.name: results[c.name].metric_value for c in candidates}
    bounds: dict[str, float] = {}
    verdicts: list[str] = []
    eligible: list[str] = []
    for c in candidates:
        r = results[c.name]
        if labels is not None:
            lb = paired_auc_lower_bound(r.rewards, champion, labels, rl.gate_confidence, rl.bootstrap_samples, rl.seed)
        else:
            lb = paired_bootstrap_lower_bound(
                [a - b for a, b in zip(r.rewards, champion)], rl.gate_confidence, rl.bootstrap_samples, rl.seed
            )
        bounds[c.name] = lb
        if refusal is not None:
            verdicts.append(f"{c.name}: {unit} {values[c.name]:.3f}")
        elif any(math.isnan(x) for x in (*r.rewards, r.mean_kl, r.mean_length)):
            verdicts.append(f"{c.name}: NaN in {unit}s, KL or length")
        elif r.mean_kl > rl.max_kl:
            verdicts.append(f"{c.name}: mean KL to base {r.mean_kl:.3f} > max_kl {rl.max_kl}")
        elif r.mean_length > rl.max_mean_length:
            verdicts.append(f"{c.name}: mean length {r.mean_length:.1f} tokens > max_mean_length {rl.max_mean_length}")
        elif not lb > rl.gate_margin:
            verdicts.append(
                f"{c.name}: {unit} {values[c.name]:.3f} vs {champion_label} {champion_value:.3f}, "
                f"{rl.gate_confidence:.0%} lower bound {lb:+.3f} does not exceed margin {rl.gate_margin}"
            )
        else:
            eligible.append(c.name)
            verdicts.append(
                f"{c.name}: beats {champion_label} on {unit} by lower bound {lb:+.3f} > margin {rl.gate_margin}"
            )
    winner = max(eligible, key=lambda n: (bounds[n], values[n])) if eligible else None
    if refusal is not None:
        head = f"keep {champion_label}: {refusal}"
    else:
        head = f"promote {winner}" if winner else f"keep {champion_label}: no candidate passed"
    return GateDecision(
        served_model=served_model,
        winner=winner,
        reason=f"{head}. " + "; ".join(verdicts),
        champion_reward_mean=champion_value,
        candidate_reward_means=values,
        lower_bounds=bounds,
        metric=rl.gate_metric,
    )
