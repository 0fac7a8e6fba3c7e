"""The reward model's part of a round (called by :class:`trainer.round.RoundRecipe`).

1. :func:`reward_data`: before any model work, whether this round trains a
   reward model and the feedback of its train / held-out splits.
2. :func:`create` (the round's setup): the reward adapter is created in the round's adapter
   store (from the previous round's reward model under
   ``out_dir.parent / "last" / <name>``, else the reward champion, else fresh,
   per ``[reward_model] start``).
3. :func:`train_phase` (the first phase of the round's training): it is trained on the train split
   only, then it and the current reward champion (when its folder is given) are evaluated on the
   held-out split.
4. :func:`score_rollouts`: every step, the fresh rollouts of the candidates
   whose reward uses ``reward_model`` are scored in one batched pass; the
   scores reach the reward mix as ``metadata["reward_model_score"]``.
5. :func:`finish`: the adapter and its head are saved and kept as ``last``.

One reward model per round, from all rows of the split (every served model's
traffic): the users' verdict is what it learns, whichever adapter answered.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from trainer.adapters.store import AdapterStore, keep_as_last
from trainer.model.base import ResidentBase
from trainer.config import (
    ALGORITHM_TRAITS,
    CandidateConfig,
    GateMetric,
    RewardModelConfig,
    RLConfig,
    uses_reward_model,
)
from trainer.data import feedback_data
from trainer.errors import NotEnoughDataError, TrainerConfigError
from trainer.reward_model.model import (
    RewardModel,
    create_reward_model,
    evaluate_reward_model,
    tokenise_feedback,
    train_reward_model,
)
from trainer.rewards import REWARD_MODEL_SCORE
from trainer.types import FeedbackData, PhaseHook, RewardModelReport, RewardModelResult, RoundData, Sample

log = logging.getLogger(__name__)


@dataclass
class RewardPhase:
    """The round's reward model (None when it trained none) and its held-out reports."""

    model: RewardModel | None = None
    report: RewardModelReport | None = None
    champion_report: RewardModelReport | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    train: FeedbackData | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def check_config(candidates: Sequence[CandidateConfig], cfg: RewardModelConfig, rl: RLConfig) -> bool:
    """Whether this round trains a reward model.

    Raises:
        TrainerConfigError: a candidate uses ``reward_model`` while ``[reward_model] enabled = false``,
            a non-``grpo``/``ppo_clip`` candidate uses it, or a candidate has the reward model's name.
    """
    users = [c for c in candidates if uses_reward_model(c)]
    problems = []
    if users and cfg.enabled is False:
        problems.append(
            f"candidates {[c.name for c in users]} use reward 'reward_model' but [reward_model] enabled = false"
        )
    offline = [c.name for c in users if not ALGORITHM_TRAITS[c.algorithm].online]
    if offline:
        problems.append(
            f"candidates {offline} use reward 'reward_model', which scores fresh rollouts: only grpo / ppo_clip have them"
        )
    if any(c.name == cfg.name for c in candidates):
        problems.append(f"a candidate is named {cfg.name!r} like the reward model; rename one ([reward_model] name)")
    if problems:
        raise TrainerConfigError("; ".join(problems))
    return cfg.wanted(list(candidates), rl.gate.metric)


def reward_data(
    data: RoundData, candidates: Sequence[CandidateConfig], cfg: RewardModelConfig, rl: RLConfig
) -> tuple[tuple[FeedbackData, FeedbackData] | None, dict[str, str]]:
    """The train / held-out feedback when this round trains a reward model (else None), and the candidates
    this round skips for want of one (name -> reason). Under ``positives_from = "explicit"`` its labels are
    :func:`~trainer.data.explicit_rows`' (capped per user and key as the split is).

    A round that wants a reward model but whose train split has fewer than ``min_examples`` labelled rows,
    or rows of one label only, trains none: the candidates that learn from ``reward_model`` sit this round
    out (logged, with the reason), and the others train as usual; a window with too few ratings for the
    reward model may still hold what KTO or a verifiable reward learns from.

    Raises:
        TrainerConfigError: see :func:`check_config`.
        NotEnoughDataError: too little labelled feedback for the reward model, and every candidate needs it,
            or the gate does (``[rl.gate] metric = "reward_model"``).
    """
    if not check_config(candidates, cfg, rl):
        return None, {}
    train_fb, heldout_fb = data.train_feedback, data.heldout_feedback
    if cfg.positives_from != "any":
        shares = {"max_user_share": rl.split.max_user_share, "max_key_share": rl.split.max_key_share}
        train_fb = feedback_data(data.train, positives_from=cfg.positives_from, **shares)
        heldout_fb = feedback_data(data.heldout, positives_from=cfg.positives_from, **shares)
    if len(train_fb.examples) >= cfg.min_examples and train_fb.positives and train_fb.negatives:
        return (train_fb, heldout_fb), {}
    why = (
        f"the training split has {len(train_fb.examples)} rows with feedback ({train_fb.positives} up, {train_fb.negatives} down); "
        f"the reward model needs at least [reward_model] min_examples = {cfg.min_examples} with both labels"
    )
    if rl.gate.metric == GateMetric.REWARD_MODEL:  # the gate could promote nothing: refuse before any model work
        raise NotEnoughDataError(
            f"the gate ranks candidates by the reward model ([rl.gate] metric = 'reward_model'), but none could be "
            f"trained: {why}; widen the window, collect more feedback, or lower min_examples"
        )
    users = [c.name for c in candidates if uses_reward_model(c)]
    if users and len(users) == len(candidates):
        raise NotEnoughDataError(
            f"candidates {users} learn from reward 'reward_model', but no reward model could be trained: {why}; "
            "widen the window, collect more feedback, or lower min_examples"
        )
    skipped = {name: f"no reward model this round ({why})" for name in users}
    log.warning("no reward model this round: %s%s", why, f"; skipping candidates {users}" if users else "")
    return None, skipped


@contextmanager
def naming_skipped(skipped: Mapping[str, str]) -> Iterator[None]:
    """Inside, a :class:`NotEnoughDataError` (e.g. the candidates left have no training rows) is raised again
    naming the candidates that sat the round out for want of a reward model (``skipped``, from
    :func:`reward_data`), so the round's refusal says why none of them trained either."""
    try:
        yield
    except NotEnoughDataError as err:
        if not skipped:
            raise
        sat_out = "; ".join(f"{name}: {why}" for name, why in skipped.items())
        raise NotEnoughDataError(f"{err}; sat this round out: {sat_out}") from err


def start_dir(cfg: RewardModelConfig, out_dir: Path, champion: Path | None) -> Path | None:
    """``start = "self"``: the previous round's reward model, else the reward champion; ``fresh``: None."""
    if cfg.start == "fresh":
        return None
    last = out_dir.parent / "last" / cfg.name
    if (last / "adapter_model.safetensors").is_file():
        return last
    return champion


def create(
    base: ResidentBase, store: AdapterStore, cfg: RewardModelConfig, rl: RLConfig, out_dir: Path, champion: Path | None
) -> RewardModel:
    """The round's reward model (adapter + head) in ``store``, at its start point (:func:`start_dir`)."""
    return create_reward_model(base, store, cfg, start_dir(cfg, out_dir, champion), rl.seed)


def train_phase(
    model: RewardModel,
    cfg: RewardModelConfig,
    rl: RLConfig,
    data: tuple[FeedbackData, FeedbackData],
    champion: Path | None = None,
    on_phase: PhaseHook | None = None,
) -> RewardPhase:
    """Train the round's reward model and evaluate it (see the module docstring).

    Its round metrics (``reward_model/...``) leave out undefined values (an AUC
    on held-out rows of one label); the reports keep them as NaN.

    ``champion``: the folder of the current reward champion (adapter + head) to
    re-measure on this round's held-out rows; None skips that.
    """
    started = time.perf_counter()
    train_fb, held_fb = data
    base, store = model.base, model.store
    history = train_reward_model(
        model, tokenise_feedback(base, train_fb), cfg, rl.update.max_grad_norm, rl.seed, on_phase
    )
    held = tokenise_feedback(base, held_fb)
    report = evaluate_reward_model(model, held, rl.gate.confidence, rl.gate.bootstrap_samples, rl.seed)
    champion_report = None
    if champion is not None:
        probe = create_reward_model(base, store, cfg, champion, rl.seed, name=cfg.adapter_names[1])
        try:
            champion_report = evaluate_reward_model(probe, held, rl.gate.confidence, rl.gate.bootstrap_samples, rl.seed)
        finally:
            store.delete(probe.name)
    metrics = {
        **report.as_metrics(),
        "reward_model/train_examples": float(len(train_fb.examples)),
        "reward_model/train_pairs": float(len(train_fb.pairs)),
        "reward_model/train_s": time.perf_counter() - started,
    }
    if history:
        metrics |= {
            "reward_model/train_loss": history[-1]["reward_model/loss"],
            "reward_model/train_loss_first": history[0]["reward_model/loss"],
        }
    if champion_report is not None:
        metrics |= champion_report.as_metrics("reward_model/champion")
    metrics = {
        k: v for k, v in metrics.items() if math.isfinite(v)
    }  # an AUC of one-label rows is undefined: left out, not NaN
    log.info(
        "reward model: held-out AUC %.3f (lower bound %.3f) on %d rows",
        report.auc,
        report.auc_lower_bound,
        report.heldout_examples,
    )
    return RewardPhase(model, report, champion_report, history, train_fb, metrics)


def score_rollouts(
    model: RewardModel,
    prompt_ids: Mapping[str, Sequence[Sequence[int]]],
    groups: Mapping[str, Sequence[Sequence[Sample]]],
) -> tuple[dict[str, list[list[dict[str, float]]]], dict[str, float]]:
    """Score every sample of the given candidates' groups in one batched pass.

    ``prompt_ids[name][p]`` are prompt ``p``'s ids, ``groups[name][p]`` its G samples.
    Returns per candidate ``[p][g] -> {"reward_model_score": score}`` (for
    :func:`trainer.algorithms.ppo.rollout_batch`) and ``train/reward_model_score_s``.
    """
    started = time.perf_counter()
    flat_prompts, flat_completions, shape = [], [], []
    for name in groups:
        for ids, group in zip(prompt_ids[name], groups[name]):
            shape.append((name, len(group)))
            for sample in group:
                flat_prompts.append(list(ids))
                flat_completions.append(list(sample.token_ids))
    scores = iter(model.score(flat_prompts, flat_completions))
    out: dict[str, list[list[dict[str, float]]]] = {name: [] for name in groups}
    for name, g in shape:
        out[name].append([{REWARD_MODEL_SCORE: next(scores)} for _ in range(g)])
    return out, {"train/reward_model_score_s": time.perf_counter() - started}


def finish(phase: RewardPhase, out_dir: Path) -> RewardModelResult | None:
    """Save the reward model (adapter + head) under ``out_dir/<name>/adapter`` and keep it as ``last``."""
    if phase.model is None or phase.report is None or phase.train is None:
        return None
    folder = phase.model.save(out_dir / phase.model.name / "adapter")
    keep_as_last(folder, out_dir, phase.model.name)
    return RewardModelResult(
        name=phase.model.name,
        adapter_dir=folder,
        report=phase.report,
        champion_report=phase.champion_report,
        step_metrics=tuple(phase.history),
        train_examples=len(phase.train.examples),
        train_pairs=len(phase.train.pairs),
    )
