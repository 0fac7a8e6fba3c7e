"""Typed settings of the canary (``serving.canary``) and of the post-promotion guard (``serving.guard``)."""

from __future__ import annotations

from pydantic import Field

from connectors.config_base import Section


class CanaryConfig(Section):
    """A round's winner first serves a slice of live traffic as ``@challenger``."""

    enabled: bool = Field(
        default=True,
        description="True: a round's winner becomes @challenger, promoted only on live feedback; "
        "False: it becomes @champion at once.",
    )
    alias: str = Field(
        default="challenger", pattern=r"^[a-zA-Z][a-zA-Z0-9_-]*$", description="MLflow alias of the version on canary."
    )
    fraction: float = Field(
        default=0.2,
        gt=0,
        lt=1,
        description="Share of routing keys (keyed hash of the hashed user id, else of the trace id) sent to the challenger.",
    )
    min_feedback: int = Field(default=30, ge=1, description="Feedback events each side needs before a promotion.")
    margin: float = Field(
        default=0.05,
        ge=0,
        description="Non-inferiority margin: promote when the challenger's live rate is "
        "not lower than the champion's by more than this (reward units; a rate difference for thumbs).",
    )
    alpha: float = Field(
        default=0.05, gt=0, lt=0.5, description="Error rate of the sequential test (valid at every look)."
    )
    mixture_sd: float = Field(
        default=0.1, gt=0, description="Standard deviation of the mSPRT normal mixture (effect size it is tuned for)."
    )
    max_duration_s: float = Field(
        default=86400.0, gt=0, description="Abort a canary still undecided after this many seconds."
    )
    check_interval_s: float = Field(default=30.0, gt=0, description="How often the service looks at the live evidence.")


class GuardConfig(Section):
    """After a canary promotion, watch the new champion against the previous one's live rate."""

    enabled: bool = Field(
        default=True, description="Roll back automatically when the new champion's live rate drops significantly."
    )
    period_s: float = Field(default=3600.0, gt=0, description="How long after a promotion the guard watches.")
    alpha: float = Field(default=0.05, gt=0, lt=0.5, description="Error rate of the guard's sequential test.")
