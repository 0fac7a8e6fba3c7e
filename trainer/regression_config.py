"""The ``[[rl.regression]]`` section: one regression suite against forgetting.

A suite is a JSONL file of prompts and a check (a reward function) scored greedily for every candidate
and its served model's champion each round; a candidate whose paired lower bound of (candidate -
champion) score on the suite is below ``-tolerance`` is refused by the gate
(:mod:`trainer.evaluation.regression`). The file is read when a round starts
(:func:`trainer.evaluation.regression.load_suite`); here only its name is checked.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath, PureWindowsPath

from pydantic import Field, field_validator

from connectors.config_base import Section
from trainer.rewards import TRAINING_ONLY, resolve

SHIPPED_PREFIX = "shipped:"
"""``path = "shipped:<name>"`` names a suite Hourglass ships (``trainer/evaluation/suites/<name>.jsonl``)."""

_SUITE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")
_SERVED_MODEL = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]*$")


class RegressionSuiteConfig(Section):
    """``[[rl.regression]]``: one evaluation suite that a candidate must not forget, scored each round."""

    name: str = Field(
        description="Unique slug ([a-z0-9][a-z0-9_-]{0,47}); names the suite in the gate's reason, the round "
        "metrics (`regression/<name>/...`), `/status` and the console."
    )
    path: str = Field(
        description="The suite's prompts, JSONL: one object a line with `messages` (chat, `[{role, content}]`) or "
        "`prompt` (one user message), an optional `id` and an optional `metadata` object the check reads (e.g. "
        "`reference_answer`). `shipped:<name>` names a suite Hourglass ships (`shipped:reasoning-gym-mix`); any "
        "other value is a path relative to the service's working directory (where `state_dir` resolves) and must "
        "stay inside it: absolute paths, `..` and symlinks that lead out are refused. Read when a round starts."
    )
    check: str = Field(
        description="How an answer is scored (higher is better; usually 0/1): a built-in reward name (e.g. "
        "`exact_answer`, `first_number_answer`, `short_answer`, `json_valid`) or `module:function`, "
        "resolved as candidates' rewards are. Every prompt of the suite must carry the metadata it needs."
    )
    check_kwargs: dict[str, float | int | str | bool] = Field(
        default_factory=dict, description="Keyword arguments of the check."
    )
    tolerance: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="Largest drop below the champion allowed, in the check's unit (a share of prompts for a 0/1 "
        "check): a candidate is refused unless the paired-bootstrap lower bound (at rl.gate.confidence) of its "
        "mean score minus the champion's on the same prompts is at least -tolerance.",
    )
    max_prompts: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="Prompts of the file used, from its start (the file may hold more; at most 4096 lines are read).",
    )
    max_new_tokens: int = Field(default=32, ge=1, le=4096, description="Longest greedy answer on this suite, tokens.")
    served_models: list[str] = Field(
        default_factory=list,
        description="The served models (tenants) whose candidates face this suite; empty (default): every served model.",
    )

    @field_validator("name")
    @classmethod
    def _slug(cls, name: str) -> str:
        if not _SUITE_NAME.match(name):
            raise ValueError(f"suite name {name!r} must match [a-z0-9][a-z0-9_-]{{0,47}}")
        return name

    @field_validator("path")
    @classmethod
    def _inside(cls, path: str) -> str:
        if path.startswith(SHIPPED_PREFIX):
            shipped = path.removeprefix(SHIPPED_PREFIX)
            if not _SUITE_NAME.match(shipped):
                raise ValueError(f"shipped suite {shipped!r} is not a suite name (e.g. 'shipped:reasoning-gym-mix')")
            return path
        if not path.strip() or "\x00" in path:
            raise ValueError("the suite path is empty")
        posix, windows = PurePosixPath(path), PureWindowsPath(path)
        if posix.is_absolute() or windows.is_absolute() or windows.drive or path.startswith("~"):
            raise ValueError(
                f"suite path {path!r} is absolute; give a path relative to the service's working directory"
            )
        if ".." in posix.parts or ".." in windows.parts:
            raise ValueError(f"suite path {path!r} leads out of the working directory ('..')")
        return path

    @field_validator("check")
    @classmethod
    def _known(cls, check: str) -> str:
        if check in TRAINING_ONLY:
            raise ValueError(
                f"check {check!r} cannot score new greedy answers (it reads a logged reward or the round's reward "
                "model); use a verifiable reward"
            )
        if ":" not in check:  # a built-in: checked now (a module:function is imported when the round loads the suite)
            resolve(check)
        return check

    @field_validator("served_models")
    @classmethod
    def _models(cls, models: list[str]) -> list[str]:
        bad = [m for m in models if not _SERVED_MODEL.match(m)]
        if bad:
            raise ValueError(f"served model names {bad} must match [a-zA-Z0-9][a-zA-Z0-9._-]*")
        return models

    def applies_to(self, served_model: str) -> bool:
        """Whether candidates of ``served_model`` face this suite."""
        return not self.served_models or served_model in self.served_models
