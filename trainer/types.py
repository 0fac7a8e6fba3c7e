"""Data that crosses the trainer's boundary: what a round returns.

Frozen dataclasses; ``pipeline`` reads them to log, register and promote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path


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
            f"{prefix}/auc": self.auc, f"{prefix}/auc_lower_bound": self.auc_lower_bound, f"{prefix}/accuracy": self.accuracy,
            f"{prefix}/ece": self.ece, f"{prefix}/heldout_examples": float(self.heldout_examples),
            f"{prefix}/heldout_pairs": float(self.heldout_pairs),
        }  # fmt: skip
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
