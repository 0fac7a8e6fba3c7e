"""Regression suites in the service's round (fake steps, no trainer): a candidate that forgets is refused
with the suite named in the record's reason; the per-suite scores and verdicts land in the round record
(``/status``'s recent rounds, the round metrics MLflow's round run logs) and on the status page."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from fastapi.testclient import TestClient

from pipeline.api import create_api
from pipeline.config import HourglassConfig, load_config
from pipeline.registry.models import _result_from_json, _result_to_json
from pipeline.rounds.records import RoundRecord, RoundState, RoundStore
from tests.pipeline.console.test_console_render import _service
from tests.pipeline.round_fakes import evaluated_round
from tests.pipeline.rounds.test_round_state_machine import MODEL, FakeRegistry, FakeSteps, _run
from trainer.evaluation.gate import gate_round
from trainer.regression_config import RegressionSuiteConfig
from trainer.types import PhaseHook, SuiteScores


@pytest.fixture
def cfg(tmp_path: Path) -> HourglassConfig:
    """The embedded default with the canary off (a winner is promoted at once)."""
    base = load_config(None)
    serving = base.serving.model_copy(update={"canary": base.serving.canary.model_copy(update={"enabled": False})})
    return base.model_copy(update={"state_dir": str(tmp_path), "serving": serving})


SUITE = RegressionSuiteConfig(name="reasoning", path="shipped:reasoning-gym-mix", check="short_answer")


class ForgettingSteps(FakeSteps):
    """The fake round whose only candidate beats the base on the held-out rows but answers the regression
    suite worse: 4 of 8 prompts right where the base had all 8."""

    def train_and_evaluate(self, record: RoundRecord, table: pa.Table, on_phase: PhaseHook) -> Any:
        result = super().train_and_evaluate(record, table, on_phase)
        evaluation = result.evaluations[MODEL]
        scores = SuiteScores("reasoning", tuple(f"p{i}" for i in range(8)), (1.0,) * 8, {"default": (1.0, 0.0) * 4})
        metrics = result.metrics | {"regression/reasoning/default": 0.5, f"regression/reasoning/champion/{MODEL}": 1.0}
        return replace(
            result, evaluations={MODEL: replace(evaluation, regression={"reasoning": scores})}, metrics=metrics
        )

    def register(self, result: Any) -> tuple[dict[str, str], dict[str, float]]:
        """As the live step: only the gate's winners are registered."""
        self.winner = any(d.winner for d in result.decisions.values())
        return super().register(result)


def test_a_forgetting_candidate_is_refused_and_its_suite_scores_are_recorded(
    cfg: HourglassConfig, tmp_path: Path
) -> None:
    with_suite = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"regression": [SUITE]})})
    store, registry = RoundStore(tmp_path), FakeRegistry()
    final = _run(with_suite, ForgettingSteps(registry, store), store)

    assert final.state is RoundState.NO_WINNER and registry.alias_moves == []
    assert "default: forgets on regression suite 'reasoning': 0.500 vs base 1.000 on 8 prompts" in final.reason
    (verdict,) = final.as_dict()["decisions"][MODEL]["regression"]["default"]  # what /status's recent rounds show
    assert verdict["suite"] == "reasoning" and verdict["passed"] is False and verdict["candidate_score"] == 0.5
    assert final.metrics["regression/reasoning/default"] == 0.5  # round metrics: logged to the round's MLflow run
    assert final.metrics[f"regression/reasoning/champion/{MODEL}"] == 1.0
    assert final.metrics["regression/reasoning/default/passed"] == 0.0
    assert final.metrics["regression/reasoning/default/lower_bound"] < -0.05

    without = _run(cfg, ForgettingSteps(FakeRegistry(), RoundStore(tmp_path / "b")), RoundStore(tmp_path / "b"))
    assert without.state is RoundState.DONE  # the same candidate without the suite configured: promoted


def test_a_pending_registration_keeps_the_regression_verdicts(cfg: HourglassConfig, tmp_path: Path) -> None:
    """The outbox entry of a round (written before MLflow answers) reads back with its typed verdicts."""
    rl = cfg.rl.model_copy(update={"regression": [SUITE]})
    result = evaluated_round("r1")
    scores = SuiteScores("reasoning", ("p0", "p1"), (1.0, 1.0), {"default": (1.0, 1.0)})
    result = replace(result, evaluations={MODEL: replace(result.evaluations[MODEL], regression={"reasoning": scores})})
    gated = gate_round(result, rl)
    back, _ = _result_from_json(_result_to_json(gated, tmp_path, False))
    assert back.decisions[MODEL].regression == gated.decisions[MODEL].regression
    assert back.decisions[MODEL].regression["default"][0].passed


def test_the_status_page_shows_each_suite_and_who_forgets(tmp_path: Path) -> None:
    service = _service(tmp_path)
    record = service.store.create("api", ["default", "steady"], "1h")
    verdict = {"suite": "reasoning", "champion_score": 0.75, "tolerance": 0.05, "prompts": 64}
    record.decisions = {
        MODEL: {
            "winner": None,
            "reason": "keep base: no candidate passed",
            "champion_reward": 0.25,
            "candidate_rewards": {"default": 0.5, "steady": 0.3},
            "lower_bounds": {"default": 0.1, "steady": 0.0},
            "regression": {
                "default": [verdict | {"candidate_score": 0.5, "lower_bound": -0.31, "passed": False}],
                "steady": [verdict | {"candidate_score": 0.75, "lower_bound": 0.0, "passed": True}],
            },
        }
    }
    service.store.save(record)
    with TestClient(create_api(service), base_url="http://127.0.0.1") as client:
        html = client.get("/console/panels").text
        data = client.get("/console/data").json()
    (suite,) = data["rounds"][0]["decisions"][0]["suites"]
    assert suite["suite"] == "reasoning" and suite["champion"] == 0.75
    assert [(c["name"], c["score"], c["passed"]) for c in suite["candidates"]] == [
        ("default", 0.5, False),
        ("steady", 0.75, True),
    ]
    assert 'data-suite="reasoning"' in html and '<span class="forgets">forgets</span>' in html
