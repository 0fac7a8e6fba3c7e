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
