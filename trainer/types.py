"""The trainer's vocabulary: the records a reader of a round meets.

- what a round learns from: :class:`Prompt` (a snapshot row or a generated task) and
  :class:`Sample` (a rollout, or the logged completion of a row);
- what it reports while it runs: :class:`RoundPhase`, :class:`PhaseBoundary`, :data:`PhaseHook`;
- what it returns: :class:`RoundResult` with its :class:`CandidateResult` s, :class:`GateDecision` s
  and :class:`RewardModelResult`.

Frozen dataclasses; ``pipeline`` reads them to log, register and promote, and
moves its round state machine on the :class:`PhaseBoundary` hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One training or evaluation prompt.

    ``messages`` is the chat (``[{role, content}]``); ``metadata`` the row's
    metadata (``reference_answer``, ...). The ``logged_*`` fields hold the
    served completion of a buffer row (for offline learning); None otherwise.
    ``logged_correction`` is the user's corrected answer from the trace's
    feedback, when the snapshot has a ``correction`` column and the user gave one.
    """

    prompt_id: str
    messages: list[dict[str, str]]
    metadata: dict[str, Any] = field(default_factory=dict)
    logged_completion: str | None = None
    logged_token_ids: list[int] | None = None
    logged_logprobs: list[float] | None = None
    logged_reward: float | None = None
    logged_adapter_version: str | None = None
    logged_correction: str | None = None


@dataclass(frozen=True)
class Sample:
    """One completion and where it came from.

    ``token_ids`` / ``logprobs`` are the completion tokens and the natural-log
    probability of each under the policy that sampled it (length T each).
    ``adapter_version`` names the adapter version that produced it (``base``
    for the base model); ``reward`` is filled in by scoring.
    """

    prompt_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    adapter_version: str
    finish_reason: str = "length"
    reward: float | None = None


class RoundPhase(StrEnum):
    """The trainer's phases of a round, in order: the reward model (when the round trains one),
    the candidates' training steps, then evaluation (which ends with the gate)."""

    REWARD_MODEL = "reward_model"
    TRAIN = "train"
    EVALUATE = "evaluate"


@dataclass(frozen=True, eq=False)
class PhaseBoundary:
    """A point between two units of work where the caller may stop the round (by raising).

    - ``PhaseBoundary(RoundPhase.REWARD_MODEL, step=k)``: before reward-model step ``k``;
    - ``PhaseBoundary(RoundPhase.TRAIN, step=k)``: before candidate training step ``k``;
    - ``PhaseBoundary(RoundPhase.EVALUATE)``: evaluation starts (the candidates are trained);
    - ``PhaseBoundary(RoundPhase.EVALUATE, part="greedy")``: before the greedy answers;
    - ``PhaseBoundary(RoundPhase.EVALUATE, part="score", candidate=c)``: before candidate ``c`` is scored.

    ``label`` is the short form logs and messages use (``"train:3"``, ``"evaluate:score:a"``);
    a boundary compares equal to its label, so a hook may match either.
    """

    phase: RoundPhase
    step: int | None = None
    part: str | None = None
    candidate: str | None = None

    @property
    def label(self) -> str:
        tail = [str(x) for x in (self.step, self.part, self.candidate) if x is not None]
        return ":".join([self.phase.value, *tail])

    @property
    def starts_phase(self) -> bool:
        """True for the boundary that opens ``phase`` as a whole (``evaluate``), not one inside it."""
        return self.step is None and self.part is None

    def __str__(self) -> str:
        return self.label

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PhaseBoundary):
            return (self.phase, self.step, self.part, self.candidate) == (
                other.phase,
                other.step,
                other.part,
                other.candidate,
            )
        if isinstance(other, str):
            return self.label == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.label)


PhaseHook = Callable[[PhaseBoundary], None]
"""Called by the trainer at every :class:`PhaseBoundary`; it may raise to stop the round there."""


@dataclass(frozen=True)
class CandidateResult:
    """One trained candidate at the end of a round.

    ``adapter_dir`` is a PEFT folder (``adapter_config.json`` +
    ``adapter_model.safetensors``) ready for vLLM's ``/v1/load_lora_adapter``.
    ``step_metrics`` has one dict per optimizer step, namespaced keys
    (``train/loss``, ``train/reward_mean``, ``train/kl``, ...).
    ``eval_rewards`` is aligned with ``RoundResult.eval_prompt_ids``.
    """

    name: str
    served_model: str
    recipe: dict[str, object]
    adapter_dir: Path
    step_metrics: tuple[dict[str, float], ...]
    eval_rewards: tuple[float, ...]
    eval_metrics: dict[str, float]


@dataclass(frozen=True)
class GateDecision:
    """The gate's verdict for one served model (tenant).

    ``winner`` is a candidate name or None; ``reason`` says why in words.
    ``metric`` is the gate metric (``verifiable``, ``reward_model`` or
    ``feedback``); ``champion_reward_mean`` and ``candidate_reward_means``
    hold each policy's value under it (mean reward, mean reward-model score,
    or feedback AUC), and ``lower_bounds`` maps candidate name to the
    paired-bootstrap lower confidence bound of (candidate - champion) value.
    """

    served_model: str
    winner: str | None
    reason: str
    champion_reward_mean: float
    candidate_reward_means: dict[str, float]
    lower_bounds: dict[str, float]
    metric: str = "verifiable"


@dataclass(frozen=True)
class RoundResult:
    """Everything a round produced."""

    round_id: str
    base_fingerprint: str
    window_start: datetime
    window_end: datetime
    train_rows: int
    heldout_rows: int
    eval_prompt_ids: tuple[str, ...]
    candidates: tuple[CandidateResult, ...]
    decisions: dict[str, GateDecision]
    metrics: dict[str, float] = field(default_factory=dict)
    reward_model: RewardModelResult | None = None  # the round's reward model, when it trained one


@dataclass(frozen=True)
class RewardModelReport:
    """Held-out evaluation of a reward model (scores vs users' binary feedback).

    ``auc``: ROC AUC of the scores against ``label = reward > 0`` (NaN when the
    held-out rows carry one label only); ``auc_lower_bound``: its bootstrap lower
    bound at ``rl.gate_confidence``; ``accuracy``: share of rows where
    ``score > 0`` agrees with the label; ``ece``: expected calibration error of
    ``sigmoid(score)`` over 10 equal-width bins (Guo et al. 2017); ``pair_accuracy``:
    share of held-out preference pairs ranked right (None without pairs).
    """

    auc: float
    auc_lower_bound: float
    accuracy: float
    ece: float
    pair_accuracy: float | None
    heldout_examples: int
    heldout_pairs: int

    def as_metrics(self, prefix: str = "reward_model") -> dict[str, float]:
        """``{"reward_model/auc": ..., ...}``; ``pair_accuracy`` only when there were pairs."""
        out = {
            f"{prefix}/auc": self.auc,
            f"{prefix}/auc_lower_bound": self.auc_lower_bound,
            f"{prefix}/accuracy": self.accuracy,
            f"{prefix}/ece": self.ece,
            f"{prefix}/heldout_examples": float(self.heldout_examples),
            f"{prefix}/heldout_pairs": float(self.heldout_pairs),
        }
        if self.pair_accuracy is not None:
            out[f"{prefix}/pair_accuracy"] = self.pair_accuracy
        return out


@dataclass(frozen=True)
class RewardModelResult:
    """The reward model a round trained: where it was saved and how it did on held-out feedback.

    ``adapter_dir`` holds the PEFT folder plus ``reward_head.safetensors``.
    ``champion_report`` is the current reward champion re-measured on the same
    held-out rows (None when there was no champion or its files were not available).
    """

    name: str
    adapter_dir: Path
    report: RewardModelReport
    champion_report: RewardModelReport | None
    step_metrics: tuple[dict[str, float], ...]
    train_examples: int
    train_pairs: int
