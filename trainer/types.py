"""The trainer's vocabulary: the records a reader of a round meets, in the order a round meets them.

1. what it is asked: :class:`RoundSpec` (model, candidates, ``[rl]``) and :class:`RoundInputs`
   (:class:`RoundData` plus the champions to beat);
2. what it learns from: :class:`Prompt` s (snapshot rows or generated tasks), the users' feedback as
   :class:`LabelledExample` s and :class:`PreferencePair` s (:class:`FeedbackData`), and :class:`Sample` s
   (rollouts, or the logged completions of rows);
3. what it reports while it runs: :class:`RoundPhase`, :class:`PhaseBoundary`, :data:`PhaseHook`;
4. what it returns: :class:`RoundResult` with its :class:`CandidateResult` s, one :class:`TenantEvaluation`
   per served model (each candidate's :class:`EvalResult` and the champion's values: all the gate reads),
   the gate's :class:`GateDecision` s once the gate ran, and the :class:`RewardModelResult`.

Frozen dataclasses; ``pipeline`` reads them to gate, log, register and promote, and
moves its round state machine on the :class:`PhaseBoundary` hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from connectors.reward import explicit_source
from connectors.schema import hidden_characters
from trainer.config import CandidateConfig, ModelConfig, RewardModelConfig, RLConfig
from trainer.errors import TrainerConfigError

# --- 1. what a round is asked -------------------------------------------------------------------


@dataclass(frozen=True)
class RoundSpec:
    """What one round trains: the resident base, the candidates (config order) and how (``[rl]``, with
    ``[rl.reward_model]`` for the reward model it trains when a candidate or the gate needs one)."""

    model: ModelConfig
    candidates: tuple[CandidateConfig, ...]
    rl: RLConfig

    def __post_init__(self) -> None:
        """Raises TrainerConfigError listing every problem: no candidates, duplicate names, a name the reward
        model's adapters take."""
        problems = []
        if not self.candidates:
            problems.append("no candidates given")
        names = [c.name for c in self.candidates]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            problems.append(f"duplicate candidate names {dupes}")
        taken = sorted(set(names) & set(self.rl.reward_model.adapter_names))
        if taken:
            problems.append(f"candidate names {taken} are the reward model's adapters (rl.reward_model.name)")
        if problems:
            raise TrainerConfigError("; ".join(problems))


@dataclass(frozen=True)
class RoundData:
    """A round's data, read once from its train and held-out snapshot tables
    (:func:`trainer.data.prepare_round_data`).

    ``train`` / ``heldout``: one :class:`Prompt` per row, oldest first; ``train_feedback`` /
    ``heldout_feedback``: the users' verdicts in them (the reward model's examples and pairs);
    ``window_start`` / ``window_end``: the oldest and newest ``ts`` of both; ``metrics``: ``data/users``,
    ``data/max_user_share``, ``data/keys``, ``data/max_key_share`` and the same with ``heldout_`` (after the caps).
    """

    train: tuple[Prompt, ...]
    heldout: tuple[Prompt, ...]
    train_feedback: FeedbackData
    heldout_feedback: FeedbackData
    window_start: datetime
    window_end: datetime
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundInputs:
    """What one round learns from and competes against: its :class:`RoundData`; per served model
    the folder of its champion adapter (None or absent: the base is champion); the reward model's
    champion (adapter + head; None: none), re-measured on this round's held-out rows and, with
    ``[reward_model] start = "self"``, the start when there is no previous round's reward model."""

    data: RoundData
    champions: Mapping[str, Path | None] = field(default_factory=dict)
    reward_champion: Path | None = None


# --- 2. what it learns from ----------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One training or evaluation prompt.

    ``messages`` is the chat (``[{role, content}]``); ``metadata`` the row's
    metadata (``reference_answer``, ...). The ``logged_*`` fields hold the
    served completion of a buffer row (for offline learning); None otherwise.
    ``logged_correction`` is the user's corrected answer from the trace's
    feedback, when the snapshot has a ``correction`` column and the user gave one.

    Conversations (``hourglass.trace/v2``): ``messages`` is the whole conversation up to the rated
    assistant turn (system prompt, earlier turns, tool results), ``tools`` the OpenAI function tools
    that turn offered (also in ``metadata["tools"]``, where the tool-call rewards read them),
    ``logged_prompt_token_ids`` the prompt's ids as vLLM rendered and served them (chat template and tools
    included; used as they are, never rendered again), and ``logged_tool_calls`` the rated answer's tool
    calls (its ``logged_completion`` is ``""`` when it only calls tools). None on v1 rows.
    """

    prompt_id: str
    messages: list[dict[str, Any]]
    metadata: dict[str, Any] = field(default_factory=dict)
    logged_completion: str | None = None
    logged_token_ids: list[int] | None = None
    logged_logprobs: list[float] | None = None
    logged_reward: float | None = None
    logged_adapter_version: str | None = None
    logged_correction: str | None = None
    tools: list[dict[str, Any]] | None = None
    logged_prompt_token_ids: list[int] | None = None
    logged_tool_calls: list[dict[str, Any]] | None = None
    logged_reward_source: str | None = None  # the snapshot's reward_source: "thumbs", "continued", "thumbs+edited"...


def implicit_label(p: Prompt) -> bool:
    """Whether the row's label comes from implicit signals alone (``continued``, ``rephrased``...): its
    ``reward_source`` names no reward the user gave. A row with no source (written before implicit signals
    existed) counts as explicit."""
    return bool(p.logged_reward_source) and not explicit_source(p.logged_reward_source)


CORRECTION_SOURCE = "correction"
"""The ``logged_reward_source`` of a row made from a user's correction (:func:`trainer.data.correction_row`)."""


def correction_text(p: Prompt) -> str | None:
    """The user's correction of ``p``'s answer when it says something: a string with a visible character and
    none a reader cannot see (:func:`connectors.schema.hidden_characters`: ingest refuses them since
    2026-12-07, older rows may hold them) that differs from the logged answer other than by surrounding
    whitespace, without that whitespace; None otherwise."""
    correction = p.logged_correction
    if not isinstance(correction, str) or not any(c.isprintable() and not c.isspace() for c in correction):
        return None
    if hidden_characters(correction):
        return None
    if p.logged_completion is not None and correction.strip() == p.logged_completion.strip():
        return None
    return correction.strip()


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


@dataclass(frozen=True)
class LabelledExample:
    """One served completion and the user's verdict on it.

    ``completion_token_ids`` are the logged token ids (None: tokenise ``completion``, or render the answer's
    ``tool_calls`` with the chat template); ``prompt_token_ids`` the logged prompt ids (None: render
    ``messages`` with ``tools``).
    """

    trace_id: str
    messages: list[dict[str, Any]]
    completion: str
    completion_token_ids: tuple[int, ...] | None
    reward: float
    label: bool
    tools: list[dict[str, Any]] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    source: str = ""  # the signals the label came from, "+"-joined (the snapshot's reward_source; "" unknown)


@dataclass(frozen=True)
class PreferencePair:
    """``chosen`` ≻ ``rejected`` for the same prompt.

    ``source`` is ``"feedback"`` (two rated completions of one prompt) or
    ``"correction"`` (the user's correction over the served completion).
    Token ids None: tokenise the text. ``tools`` / ``prompt_token_ids``: the prompt's tools offered and
    its logged ids (from the chosen row; None: render ``messages`` with ``tools``); ``rejected_tool_calls``:
    the rejected answer's tool calls (rendered when it has no logged ids).
    """

    messages: list[dict[str, Any]]
    chosen: str
    chosen_token_ids: tuple[int, ...] | None
    rejected: str
    rejected_token_ids: tuple[int, ...] | None
    source: str
    tools: list[dict[str, Any]] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    chosen_tool_calls: list[dict[str, Any]] | None = None
    rejected_tool_calls: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class FeedbackData:
    """What one split of a snapshot teaches the reward model."""

    examples: tuple[LabelledExample, ...]
    pairs: tuple[PreferencePair, ...]

    @property
    def positives(self) -> int:
        return sum(e.label for e in self.examples)

    @property
    def negatives(self) -> int:
        return len(self.examples) - self.positives


# --- 3. what it reports while it runs ---------------------------------------------------------


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


# --- 3b. what the training phase and the rollouts are handed --------------------------------------


@dataclass(frozen=True)
class TrainJob:
    """The training phase of one round, as an executor receives it (:mod:`trainer.executors`).

    ``starts``: candidate name -> the folder its adapter starts from (None: fresh), resolved by the round
    (champion, ``last``, or nothing). ``on_phase``: called with ``PhaseBoundary(RoundPhase.TRAIN, step=k)``
    before every step; may raise to cancel. ``reward_cfg``: the ``[reward_model]`` settings when the round
    scores rollouts with its reward model (the Ray executor rebuilds the model on the actors with them).
    """

    model_cfg: ModelConfig
    candidates: tuple[CandidateConfig, ...]
    train_prompts: tuple[Prompt, ...]
    rl: RLConfig
    starts: dict[str, Path | None]
    out_dir: Path
    round_id: str
    progress: bool = False
    on_phase: PhaseHook | None = None
    reward_cfg: RewardModelConfig | None = None


@dataclass
class TrainOutcome:
    """What training left behind: per-candidate step metrics, the final published version name of each
    candidate (live in the caller's engine and store), rollout metrics, and the executor's own metrics
    (``executor/...``)."""

    history: dict[str, list[dict[str, float]]]
    versions: dict[str, str]
    rollout_metrics: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)


BASE_VERSION = "base"
"""The rollout version name of the base model with no adapter (:mod:`trainer.rollout`)."""


@dataclass(frozen=True)
class RolloutRequest:
    """``n`` completions of one prompt from one adapter version (:mod:`trainer.rollout`).

    ``temperature == 0`` means greedy. ``prompt_token_ids`` already has the chat template applied (with the
    generation prompt).
    """

    version: str
    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    n: int
    max_new_tokens: int
    temperature: float = 1.0
    seed: int = 0


# --- 4. what it returns ---------------------------------------------------------------------------


class Comparison(StrEnum):
    """How the gate compares a candidate with the champion on the same held-out rows: the paired
    per-row differences' mean, or the AUC difference against each row's up-vote."""

    MEAN = "mean"
    AUC = "auc"


@dataclass(frozen=True)
class EvalResult:
    """One policy's held-out answers and values under the gate metric (aligned with the rows).

    ``rewards[i]`` is row ``i``'s value: the gate reward or reward-model score
    of the greedy answer, or (``feedback``) the implicit reward of the logged
    completion. ``value`` is the gate metric's value (the AUC for
    ``feedback``); None means the mean of ``rewards``. ``mean_kl``: mean k3 KL to the base
    on its greedy answers (nats per token); ``mean_length``: their mean length, tokens.
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


@dataclass(frozen=True)
class AnswerTally:
    """Counts over some answers (a side's, or one user's or one API key's part of it) that the reward-hack
    monitors' readings are ratios of (:mod:`trainer.evaluation.monitors`). Additive: a side without one
    unit is ``side - unit``, with no answer judged again. ``words``: whitespace-separated words in all;
    ``formatted`` of ``format_rows`` (rows the format mix can score) match it; ``evasions`` of ``answers``;
    ``invalid_tool_calls`` of ``tool_rows`` (answers to rows that offered tools)."""

    answers: int = 0
    words: int = 0
    format_rows: int = 0
    formatted: int = 0
    evasions: int = 0
    tool_rows: int = 0
    invalid_tool_calls: int = 0

    def __add__(self, other: AnswerTally) -> AnswerTally:
        return AnswerTally(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: AnswerTally) -> AnswerTally:
        return AnswerTally(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else float("nan")


@dataclass(frozen=True)
class SideReading:
    """One side's reward-hack monitor measurements (:mod:`trainer.evaluation.monitors`; NaN when the side
    has no answer they apply to) and how many answers each rests on: ratios of ``total``. ``users`` and
    ``keys``: each user's (``metadata.user_hash``, rows without one are one user) and each API key's
    (``metadata.key_hash``, rows without one are one key) part of ``total``, which the monitors leave out
    one at a time (no single user or key may cause a refusal)."""

    total: AnswerTally
    users: Mapping[str, AnswerTally] = field(default_factory=dict)
    keys: Mapping[str, AnswerTally] = field(default_factory=dict)

    @property
    def answers(self) -> int:
        return self.total.answers

    @property
    def mean_words(self) -> float:
        """Mean answer length in words."""
        return _ratio(self.total.words, self.total.answers)

    @property
    def format_rows(self) -> int:
        return self.total.format_rows

    @property
    def format_share(self) -> float:
        """Share of the answers the format mix can score that match it."""
        return _ratio(self.total.formatted, self.total.format_rows)

    @property
    def evasion_rate(self) -> float:
        """Share of answers that refuse or answer with a question."""
        return _ratio(self.total.evasions, self.total.answers)

    @property
    def tool_rows(self) -> int:
        return self.total.tool_rows

    @property
    def invalid_tool_call_rate(self) -> float:
        """Of the answers to rows that offered tools, the share holding an invalid tool call."""
        return _ratio(self.total.invalid_tool_calls, self.total.tool_rows)

    def without(self, part: AnswerTally) -> SideReading:
        """This side with ``part`` (one unit's tally, or none) taken out; its per-unit parts are not kept."""
        return SideReading(self.total - part)

    def as_metrics(self, prefix: str) -> dict[str, float]:
        """``<prefix>/mean_words``, ``format_share``, ``evasion_rate``, ``invalid_tool_call_rate`` (finite ones)."""
        values = {
            "mean_words": self.mean_words,
            "format_share": self.format_share,
            "evasion_rate": self.evasion_rate,
            "invalid_tool_call_rate": self.invalid_tool_call_rate,
        }
        return {f"{prefix}/{k}": v for k, v in values.items() if math.isfinite(v)}


@dataclass(frozen=True)
class SuiteScores:
    """One regression suite on one served model: its check's score of each greedy answer, the champion's
    and every candidate's on the same prompts (``champion[i]`` and ``candidates[name][i]`` answer prompt
    ``i``; :mod:`trainer.evaluation.regression`)."""

    suite: str
    prompt_ids: tuple[str, ...]
    champion: tuple[float, ...]
    candidates: dict[str, tuple[float, ...]]


@dataclass(frozen=True)
class SuiteVerdict:
    """The gate's verdict on one candidate for one regression suite: mean scores of the champion and the
    candidate on ``prompts`` prompts, the paired-bootstrap lower bound of mean(candidate - champion) at
    ``rl.gate.confidence``, the suite's tolerance, and ``passed`` (bound >= -tolerance). ``prompts`` = 0:
    the suite was not scored for the candidate (it fails)."""

    suite: str
    champion_score: float
    candidate_score: float
    lower_bound: float
    tolerance: float
    prompts: int
    passed: bool


@dataclass(frozen=True)
class TenantEvaluation:
    """One served model's (tenant's) held-out evaluation: everything the gate decides on
    (:func:`trainer.evaluation.gate.gate`, a pure function of this record and ``[rl]``).

    ``metric``: the gate metric (one yardstick per served model), ``unit`` what its values are and
    ``comparison`` how the gate compares them (:data:`trainer.evaluation.metrics.GATE_METRICS`); ``candidates``: the candidates
    competing for it, in config order, with their results; ``champion``: the champion's per-row
    values on the same rows under the same yardstick, and ``champion_value`` its value (mean, or AUC
    for ``feedback``); ``champion_label``: ``base`` or ``champion <folder>``; ``labels``: each row's
    up-vote (``feedback`` only); ``refusal``: why this round may promote nothing (no usable row, a
    reward model at chance), None when it may. ``readings``: per candidate, the reward-hack monitors'
    measurements of its greedy answers, ``champion_reading`` the champion's (None: not measured; the gate
    applies ``[rl.monitors]`` to them, :mod:`trainer.evaluation.monitors`); ``reward_model_gains``: per
    candidate, the round's reward model's predicted thumbs-up rate of its answers minus the champion's
    (absent without a reward model); ``regression``: suite name -> the regression suites' scores
    (``[[rl.regression]]`` suites of this served model).
    """

    served_model: str
    metric: str
    unit: str
    comparison: Comparison
    candidates: dict[str, EvalResult]
    champion: tuple[float, ...]
    champion_value: float
    champion_label: str
    labels: tuple[bool, ...] | None = None
    refusal: str | None = None
    readings: dict[str, SideReading] = field(default_factory=dict)
    champion_reading: SideReading | None = None
    reward_model_gains: dict[str, float] = field(default_factory=dict)
    regression: dict[str, SuiteScores] = field(default_factory=dict)


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
    paired-bootstrap lower confidence bound of (candidate - champion) value. ``regression`` maps
    candidate name to its :class:`SuiteVerdict` s on the served model's regression suites (config order).
    """

    served_model: str
    winner: str | None
    reason: str
    champion_reward_mean: float
    candidate_reward_means: dict[str, float]
    lower_bounds: dict[str, float]
    metric: str = "verifiable"
    regression: dict[str, tuple[SuiteVerdict, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundResult:
    """Everything a round produced. The trainer fills ``evaluations`` and leaves ``decisions`` empty;
    the gate (:func:`trainer.evaluation.gate.gate_round`) fills ``decisions`` from ``evaluations``."""

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
    evaluations: dict[str, TenantEvaluation] = field(default_factory=dict)  # per served model: what the gate reads
    skipped: dict[str, str] = field(default_factory=dict)  # candidates that sat the round out -> why


@dataclass(frozen=True)
class RewardModelReport:
    """Held-out evaluation of a reward model (scores vs users' binary feedback).

    ``auc``: ROC AUC of the scores against ``label = reward > 0`` (NaN when the
    held-out rows carry one label only); ``auc_lower_bound``: its bootstrap lower
    bound at ``rl.gate.confidence``; ``accuracy``: share of rows where
    ``score > 0`` agrees with the label; ``ece``: expected calibration error of
    ``sigmoid(score)`` over 10 equal-width bins (Guo et al. 2017); ``pair_accuracy``:
    share of held-out preference pairs ranked right, a tie counting half (None without pairs); ``auc_by_signal``: the AUC on
    each feedback signal's rows (:func:`trainer.reward_model.model.auc_by_signal`; signals where it is
    undefined are absent).
    """

    auc: float
    auc_lower_bound: float
    accuracy: float
    ece: float
    pair_accuracy: float | None
    heldout_examples: int
    heldout_pairs: int
    auc_by_signal: dict[str, float] = field(default_factory=dict)

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
        out |= {f"{prefix}/auc/{signal}": value for signal, value in self.auc_by_signal.items()}
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
