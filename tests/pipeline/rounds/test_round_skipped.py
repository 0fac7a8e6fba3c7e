"""A candidate that sits a round out (no reward model could be trained for it) is named, with the reason, in
the round record (``/rounds``, ``hourglass rounds show``) and on the status page, while the others are gated
and promoted as usual. The trainer side (which candidates sit out, and when the whole round is refused) is
``tests/trainer/test_reward_model.py``; the MLflow side (a ``skipped/<name>`` param on the round's run)
``tests/pipeline/registry/test_registry.py``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
from fastapi.testclient import TestClient

from pipeline.api import create_api
from pipeline.registry.models import _result_from_json, _result_to_json
from pipeline.rounds.records import RoundRecord, RoundState, RoundStore
from tests.pipeline.rounds.test_round_regression import cfg  # noqa: F401  (fixture)
from tests.pipeline.rounds.test_round_state_machine import FakeRegistry, FakeSteps, _run
from tests.pipeline.console.test_console_render import _service
from tests.pipeline.round_fakes import evaluated_round
from trainer.types import PhaseHook

WHY = "no reward model this round (the training split has 3 rows with feedback (0 up, 3 down); ...)"


class SkippingSteps(FakeSteps):
    """The fake round, with a reward-model candidate that sat it out."""

    def train_and_evaluate(self, record: RoundRecord, table: pa.Table, on_phase: PhaseHook) -> Any:
        return replace(super().train_and_evaluate(record, table, on_phase), skipped={"grpo-rm": WHY})


def test_a_skipped_candidate_is_named_with_its_reason_and_the_round_goes_on(cfg, tmp_path: Path) -> None:  # noqa: F811
    store, registry = RoundStore(tmp_path), FakeRegistry()
    final = _run(cfg, SkippingSteps(registry, store), store)
    assert final.state is RoundState.DONE and registry.alias_moves  # the other candidate won and was promoted
    assert final.skipped == {"grpo-rm": WHY}
    assert final.reason.endswith(f"; grpo-rm sat this round out: {WHY}")  # what `hourglass retrain --wait` prints
    nothing = _run(
        cfg, SkippingSteps(FakeRegistry(), RoundStore(tmp_path / "n"), winner=False), RoundStore(tmp_path / "n")
    )
    assert nothing.state is RoundState.NO_WINNER and f"grpo-rm sat this round out: {WHY}" in nothing.reason
    assert RoundRecord.from_json(json.dumps(final.as_dict())).skipped == {"grpo-rm": WHY}

    service = _service(tmp_path / "page")
    shown = service.store.create("api", ["default", "grpo-rm"], "1h")
    shown.skipped = {"grpo-rm": WHY}
    service.store.save(shown)
    with TestClient(create_api(service), base_url="http://127.0.0.1") as client:
        html = client.get("/console/panels").text
        data = client.get("/console/data").json()
        listed = client.get("/rounds").json()
    assert data["rounds"][0]["skipped"] == {"grpo-rm": WHY}
    assert 'data-skipped="grpo-rm"' in html and "(0 up, 3 down)" in html
    assert listed[0]["skipped"] == {"grpo-rm": WHY}


def test_records_written_before_the_field_load_with_none_skipped(tmp_path: Path) -> None:
    record = RoundStore(tmp_path).create("api", ["default"], "1h")
    body = record.as_dict()
    del body["skipped"]
    assert RoundRecord.from_json(json.dumps(body)).skipped == {}


def test_a_malformed_skipped_value_shows_nothing_rather_than_failing_the_page(tmp_path: Path) -> None:
    """A record or an outbox entry edited by hand: the status page and the registration still work."""
    service = _service(tmp_path)
    for bad in (["grpo-rm"], "grpo-rm", 7):
        record = service.store.create("api", ["default"], "1h")
        record.skipped = bad  # type: ignore[assignment]
        service.store.save(record)
    with TestClient(create_api(service), base_url="http://127.0.0.1") as client:
        assert client.get("/console/panels").status_code == 200
        data = client.get("/console/data").json()
    assert [r["skipped"] for r in data["rounds"]] == [{}, {}, {}]
    entry = _result_to_json(evaluated_round("r1"), tmp_path, False) | {"skipped": ["grpo-rm"]}
    assert _result_from_json(entry)[0].skipped == {}


def test_a_record_edited_by_hand_reads_back_with_a_mapping_of_text(tmp_path: Path) -> None:
    """``/rounds``, ``hourglass rounds list`` and the demo's round lines read ``skipped`` as name -> why."""
    record = RoundStore(tmp_path).create("api", ["default"], "1h")
    for bad in (["grpo-rm"], "grpo-rm", 7, None, True):
        body = record.as_dict() | {"skipped": bad}
        assert RoundRecord.from_json(json.dumps(body)).skipped == {}
    body = record.as_dict() | {"skipped": {"grpo-rm": None, "kto": ["x"]}}
    assert RoundRecord.from_json(json.dumps(body)).skipped == {"grpo-rm": "None", "kto": "['x']"}
