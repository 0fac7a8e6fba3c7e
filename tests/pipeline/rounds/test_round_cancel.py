"""Cancel semantics of a round (fast, with the round's steps replaced by fakes):
evaluation is interruptible, a round that has started register cannot be
cancelled (the record never says cancelled after the alias moved), and a
round still running after the shutdown grace is settled as failed with its
adapters unloaded."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
from fastapi.testclient import TestClient

import pipeline.registry.models
import pipeline.registry.reward_registry
from pipeline.api import create_api
from pipeline.config import load_config
from pipeline.rounds.job import RoundNotCancellableError, RoundRunner
from pipeline.rounds.steps import LiveSteps
from pipeline.service import HourglassService
from tests.pipeline.round_fakes import evaluated_round
from tests import REPO
from trainer.types import PhaseBoundary, RoundPhase

BOUNDARIES = (
    PhaseBoundary(RoundPhase.TRAIN, step=0),
    PhaseBoundary(RoundPhase.TRAIN, step=1),
    PhaseBoundary(RoundPhase.EVALUATE),
    PhaseBoundary(RoundPhase.EVALUATE, part="greedy"),
    PhaseBoundary(RoundPhase.EVALUATE, part="score", candidate="default"),
)


def _wait(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


class FakeRound(LiveSteps):
    """The live steps with the buffer and the trainer replaced (the registry's calls by monkeypatch); each
    pauses where a test asks."""

    def __init__(self, cfg, monkeypatch: pytest.MonkeyPatch, pause_at: str) -> None:
        super().__init__(cfg, "f" * 64)
        self.pause_at = pause_at
        self.reached = threading.Event()
        self.go = threading.Event()
        self.phases: list[str] = []
        self.unloaded: list[tuple[str, list[str]]] = []
        monkeypatch.setattr(pipeline.registry.reward_registry, "save_pending", lambda cfg, result: None)
        monkeypatch.setattr(pipeline.registry.reward_registry, "register_reward_model", lambda cfg, result, **kw: None)
        monkeypatch.setattr(pipeline.registry.models, "register_winners", self.register_winners)
        monkeypatch.setattr(pipeline.registry.models, "promote_winners", self.promote_winners)

    def buffer_rows(self) -> int:
        return 10

    def snapshot(self, window, until=None):
        return pa.table({"x": list(range(10))}), {"data/rows": 10}

    def unload(self, round_id, candidates):
        self.unloaded.append((round_id, candidates))
        return {}

    def _maybe_pause(self, where: str) -> None:
        if where == self.pause_at:
            self.reached.set()
            assert self.go.wait(30)

    def train_and_evaluate(self, record, table, on_phase):
        for boundary in BOUNDARIES:
            self._maybe_pause(boundary.label)
            on_phase(boundary)
            self.phases.append(boundary.label)
        return evaluated_round(record.round_id)

    def register_winners(self, cfg, result, promotion_owed):
        self._maybe_pause("register")
        return [SimpleNamespace(model="hourglass", version="7")]

    def promote_winners(self, cfg, round_id, versions):
        return [
            {"model": m, "version": v, "action": "promoted", "reason": f"round {round_id}"} for m, v in versions.items()
        ]


@pytest.fixture
def cfg(tmp_path: Path):
    base = load_config(None)
    serving = base.serving.model_copy(update={"canary": base.serving.canary.model_copy(update={"enabled": False})})
    return base.model_copy(update={"state_dir": str(tmp_path), "serving": serving})  # the winner is promoted directly


def test_evaluation_is_interruptible(cfg, monkeypatch) -> None:
    fake = FakeRound(cfg, monkeypatch, pause_at="evaluate:greedy")
    runner = RoundRunner(cfg, "f" * 64, steps=fake)
    record = runner.start("manual")
    assert fake.reached.wait(10)
    assert runner.store.get(record.round_id).state == "evaluate"
    assert runner.cancel() is True
    fake.go.set()
    assert runner.wait(10)
    final = runner.store.get(record.round_id)
    assert final.state == "cancelled" and final.reason == "cancelled during evaluate (before greedy)"
    assert fake.phases == ["train:0", "train:1", "evaluate"]


def test_cancel_during_register_is_refused_and_the_round_finishes(cfg, monkeypatch) -> None:
    fake = FakeRound(cfg, monkeypatch, pause_at="register")
    service = HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)
    service.runner.steps = fake
    client = TestClient(create_api(service), base_url="http://localhost")  # Host must name the API
    headers = {"Authorization": f"Bearer {service.api_token}"}
    record = service.runner.start("manual")
    assert fake.reached.wait(10)
    assert service.runner.store.get(record.round_id).state == "register"
    with pytest.raises(RoundNotCancellableError, match="has started register"):
        service.runner.cancel()
    refused = client.post(f"/rounds/{record.round_id}/cancel", headers=headers)
    assert refused.status_code == 409 and "can no longer be cancelled" in refused.json()["detail"]
    fake.go.set()
    assert service.runner.wait(10)
    final = service.store.get(record.round_id)
    assert final.state == "done" and final.versions == {"hourglass": "7"}


def test_shutdown_settles_a_round_that_outlives_the_grace(cfg, monkeypatch) -> None:
    fake = FakeRound(cfg, monkeypatch, pause_at="train:1")  # stuck inside a training step: no boundary comes
    service = HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)
    service.runner.steps = fake
    service.start()
    record = service.runner.start("manual")
    assert fake.reached.wait(10)
    started = time.monotonic()
    service.shutdown(round_grace_s=0.5)
    assert time.monotonic() - started < 5
    final = service.store.get(record.round_id)
    assert final.state == "failed" and "abandoned" in final.reason and final.reason.startswith("train:")
    assert fake.unloaded == [(record.round_id, ["default"])]
    fake.go.set()  # the thread reaches the next boundary later: it must not rewrite the record
    _wait(lambda: not service.runner.running)
    assert service.store.get(record.round_id).state == "failed"


def test_shutdown_cancels_at_the_next_boundary(cfg, monkeypatch) -> None:
    fake = FakeRound(cfg, monkeypatch, pause_at="train:1")
    service = HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)
    service.runner.steps = fake
    service.start()
    record = service.runner.start("manual")
    assert fake.reached.wait(10)
    threading.Timer(0.3, fake.go.set).start()  # the step ends inside the grace
    service.shutdown(round_grace_s=10)
    final = service.store.get(record.round_id)
    assert final.state == "cancelled" and final.reason == "cancelled during train (before train step 1)"
    assert fake.unloaded == []


def test_round_grace_fits_the_units_stop_timeout() -> None:
    import configparser

    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(REPO / "deploy" / "hourglass.service")
    timeout_s = int(unit["Service"]["TimeoutStopSec"])
    schedule = load_config(None).schedule
    bound = type(schedule).model_fields["shutdown_grace_s"].metadata[-1].le
    assert bound + 30 + 10 < timeout_s  # the largest grace + ingest flush (30 s) + reconcile stop (10 s)
    with pytest.raises(ValueError, match="less than or equal to 75"):
        type(schedule)(shutdown_grace_s=300)
