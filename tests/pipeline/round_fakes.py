"""Fakes of a round's parts for pipeline tests: a round's evaluation made by hand (what the trainer
returns, one evaluation per served model, so that the pipeline's gate decides as the test wants), and
live steps on a fixed snapshot."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pyarrow as pa

from pipeline.config import HourglassConfig
from pipeline.rounds.steps import LiveSteps
from trainer.types import Comparison, EvalResult, RoundResult, TenantEvaluation

WHEN = datetime(2026, 1, 1, 10, tzinfo=timezone.utc)


def evaluation(model: str, candidate: str = "default", *, winner: bool = True, rows: int = 8) -> TenantEvaluation:
    """``candidate`` answers every held-out row right (a clear winner over a base that answers none) or
    exactly as the base does (no winner: its lower bound 0 does not exceed the margin 0)."""
    values = (1.0,) * rows if winner else (0.0,) * rows
    result = EvalResult(version=f"{candidate}-s2", samples=(), rewards=values, mean_kl=0.0, mean_length=4.0)
    return TenantEvaluation(
        served_model=model,
        metric="verifiable",
        unit="reward",
        comparison=Comparison.MEAN,
        candidates={candidate: result},
        champion=(0.0,) * rows,
        champion_value=0.0,
        champion_label="base",
    )


def evaluated_round(
    round_id: str, model: str = "hourglass", candidate: str = "default", *, winner: bool = True, **fields
) -> RoundResult:
    """A round's result as the trainer returns it: no decisions yet, one evaluation for ``model``."""
    defaults = dict(
        round_id=round_id,
        base_fingerprint="f" * 64,
        window_start=WHEN,
        window_end=WHEN,
        train_rows=16,
        heldout_rows=8,
        eval_prompt_ids=(),
        candidates=(),
        decisions={},
        metrics={"eval/prompts": 8.0},
        evaluations={model: evaluation(model, candidate, winner=winner)},
    )
    return RoundResult(**(defaults | fields))


class FixedSnapshot(LiveSteps):
    """The live steps with the reward buffer replaced by a fixed snapshot: a round through the real trainer,
    MLflow and vLLM on rows a test chose."""

    def __init__(self, cfg: HourglassConfig, base_fingerprint: str | None, table: pa.Table) -> None:
        super().__init__(cfg, base_fingerprint)
        self.table = table

    def buffer_rows(self) -> int:
        return self.table.num_rows

    def snapshot(self, window: str, until: Any = None) -> tuple[pa.Table, dict[str, Any]]:
        return self.table, {"data/rows": self.table.num_rows}
