"""Plain records that flow inside the trainer: prompts (from a snapshot or a
task generator) and samples (from a rollout engine or the logged traffic)."""

from __future__ import annotations

from dataclasses import dataclass, field
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
