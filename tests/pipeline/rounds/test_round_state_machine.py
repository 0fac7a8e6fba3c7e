"""The round state machine and its crash recovery, with injected fake steps (no MLflow, no vLLM, no
trainer): which states a round passes, that registering moves no alias and promoting does, that a
cancel lands at the next boundary, and that a crash in each state is settled so that every winner is
promoted exactly once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import sqlalchemy as sa

from pipeline.config import HourglassConfig, load_config
from pipeline.rounds.job import RoundRunner, recover
from pipeline.rounds.records import (
    TRANSITIONS,
    IllegalTransitionError,
    RoundRecord,
    RoundState,
    RoundStore,
    UnknownStateError,
    check_transition,
)
from tests.pipeline.round_fakes import evaluated_round
from trainer.errors import DataError, NotEnoughDataError
from trainer.types import PhaseBoundary, PhaseHook, RoundPhase

MODEL = "hourglass"


class ProcessDied(BaseException):
    """Stands for a SIGKILL: nothing after it runs, the record keeps the state it had."""


class FakeRegistry:
    """What survives a crash: pending folders, registered versions and the aliases."""

    def __init__(self) -> None:
        self.pending: set[str] = set()
        self.versions: dict[str, dict[str, str]] = {}  # round id -> served model -> version
        self.champion: dict[str, str] = {}
        self.alias_moves: list[tuple[str, str]] = []
        self.reachable = True

    def register(self, round_id: str) -> dict[str, str]:
        if not self.reachable:
            raise ConnectionError("MLflow unreachable")
        self.pending.discard(round_id)
        return self.versions.setdefault(round_id, {MODEL: str(len(self.versions) + 1)})


class FakeSteps:
    """Every step of a round over a :class:`FakeRegistry`; ``die_at`` names the point where the process dies."""

    def __init__(
        self,
        registry: FakeRegistry,
        store: RoundStore,
        *,
        die_at: str | None = None,
        winner: bool = True,
        rows: int = 10,
    ) -> None:
        self.registry, self.store, self.die_at, self.winner, self.rows = registry, store, die_at, winner, rows
        self.seen: list[tuple[str, RoundState]] = []  # (step, the record's persisted state when it ran)
        self.unloaded: list[str] = []
        self.on_boundary: Any = None  # test hook: called with each boundary before the runner sees it

    def _at(self, point: str, record_id: str | None = None) -> None:
        if record_id is not None:
            self.seen.append((point, self.store.get(record_id).state))
        if point == self.die_at:
            raise ProcessDied(point)

    def buffer_rows(self) -> int:
        return self.rows

    def snapshot(self, window: str, until: Any = None) -> tuple[pa.Table, dict[str, Any]]:
        self._at("snapshot")
        return pa.table({"x": list(range(self.rows))}), {"data/rows": self.rows}

    def train_and_evaluate(self, record: RoundRecord, table: pa.Table, on_phase: PhaseHook) -> Any:
        self._at("train", record.round_id)
        for boundary in (
            PhaseBoundary(RoundPhase.TRAIN, step=0),
            PhaseBoundary(RoundPhase.TRAIN, step=1),
            PhaseBoundary(RoundPhase.EVALUATE),
            PhaseBoundary(RoundPhase.EVALUATE, part="greedy"),
            PhaseBoundary(RoundPhase.EVALUATE, part="score", candidate="default"),
        ):
            if self.on_boundary is not None:
                self.on_boundary(boundary)
            on_phase(boundary)
        self._at("evaluate", record.round_id)
        return evaluated_round(record.round_id, MODEL, winner=self.winner)

    def register(self, result: Any) -> tuple[dict[str, str], dict[str, float]]:
        self._at("register:start", result.round_id)
        self.registry.pending.add(result.round_id)  # write-ahead
        self._at("register:written-ahead")
        versions = self.registry.register(result.round_id) if self.winner else {}
        self._at("register:registered")
        return versions, {"time/register_s": 0.0}

    def promote(self, record: RoundRecord) -> str:
        self._at("promote:start", record.round_id)
        for model, version in record.versions.items():
            if self.registry.champion.get(model) != version:  # idempotent, like aliases.promote
                self.registry.champion[model] = version
                self.registry.alias_moves.append((model, version))
            self._at("promote:moved")
        return ", ".join(f"promoted {m} v{v}" for m, v in record.versions.items())

    def registered_versions(self, record: RoundRecord) -> dict[str, str]:
        if record.round_id in self.registry.pending:
            return self.registry.register(record.round_id)
        if not self.registry.reachable:
            raise ConnectionError("MLflow unreachable")
        return dict(self.registry.versions.get(record.round_id, {}))

    def retry_pending_rewards(self) -> None:
        pass

    def retry_pending(self) -> None:
        pass

    def unload(self, round_id: str, candidates: list[str]) -> dict[str, list[str]]:
        self.unloaded.append(round_id)
        return {"http://replica": [f"{candidates[0]}-s1"]}


@pytest.fixture
def cfg(tmp_path: Path) -> HourglassConfig:
    base = load_config(None)
    serving = base.serving.model_copy(update={"canary": base.serving.canary.model_copy(update={"enabled": False})})
    return base.model_copy(update={"state_dir": str(tmp_path), "serving": serving})


def _run(cfg: HourglassConfig, steps: FakeSteps, store: RoundStore) -> RoundRecord:
    runner = RoundRunner(cfg, "f" * 64, store=store, steps=steps)
    record = runner.start("manual")
    assert runner.wait(10)
    return store.get(record.round_id)


def test_a_round_passes_every_state_in_order_and_only_promote_moves_the_alias(cfg, tmp_path) -> None:
    store, registry = RoundStore(tmp_path), FakeRegistry()
    steps = FakeSteps(registry, store)
    alias_at_register: list[dict[str, str]] = []
    real_register = steps.register

    def register(result: Any) -> tuple[dict[str, str], dict[str, float]]:
        alias_at_register.append(dict(registry.champion))
        return real_register(result)

    steps.register = register  # type: ignore[method-assign]
    final = _run(cfg, steps, store)
    assert final.state is RoundState.DONE and final.reason == f"promoted {MODEL} v1"
    assert [s for _, s in steps.seen] == [
        RoundState.TRAIN,
        RoundState.EVALUATE,
        RoundState.REGISTER,
        RoundState.PROMOTE,
    ]
    assert alias_at_register == [{}]  # registering moved no alias
    assert registry.alias_moves == [(MODEL, "1")] and final.versions == {MODEL: "1"}
    assert final.decisions[MODEL]["winner"] == "default" and final.metrics["eval/prompts"] == 8.0  # recorded by gate


def test_a_replay_round_snapshots_its_window_and_leaves_the_schedulers_count_alone(cfg, tmp_path) -> None:
    """A replay (``until``) trains on no new trace: it must not become the last round ``schedule.min_new_traces``
    counts from (the next scheduled round would be skipped); its window's end reaches the snapshot."""
    from datetime import datetime, timezone

    store, registry = RoundStore(tmp_path), FakeRegistry()
    steps = FakeSteps(registry, store)
    asked: list[Any] = []
    real_snapshot = steps.snapshot
    steps.snapshot = lambda window, until=None: asked.append((window, until)) or real_snapshot(window, until)  # type: ignore[method-assign]
    runner = RoundRunner(cfg, "f" * 64, store=store, steps=steps)
    until = datetime(2026, 1, 5, 7, 30, tzinfo=timezone.utc)
    replay = runner.start("api", window="2h", until=until)
    assert runner.wait(10)
    live = runner.start("manual")
    assert runner.wait(10)
    assert asked == [("2h", until), (cfg.rl.window, None)]
    assert store.get(replay.round_id).until == "2026-01-05T07:30:00+00:00"
    assert "data/buffer_trace_rows" not in store.get(replay.round_id).metrics
    assert store.get(live.round_id).metrics["data/buffer_trace_rows"] == 10


def test_records_store_until_only_on_a_replay_and_read_keys_a_newer_release_wrote(tmp_path) -> None:
    """A rollback to a release from before replays reads every record written without one (the key is left
    out), and this release reads records a newer one wrote with keys it does not know."""
    store = RoundStore(tmp_path)
    plain = store.create("manual", ["default"], "6h")
    body = store.engine.connect().execute(sa.text("select body from rounds")).scalar_one()
    assert "until" not in json.loads(body)
    newer = json.loads(body) | {"round_id": "r-newer", "some_future_field": {"x": 1}}
    assert RoundRecord.from_json(json.dumps(newer)).round_id == "r-newer"
    assert store.get(plain.round_id).until is None


def test_gate_is_a_persisted_state_between_evaluate_and_register(cfg, tmp_path) -> None:
    store, registry = RoundStore(tmp_path), FakeRegistry()
    states: list[RoundState] = []
    real_advance = store.advance

    def spy(record: RoundRecord, state: RoundState | str, reason: str | None = None) -> RoundRecord:
        states.append(RoundState(state))
        return real_advance(record, state, reason)

    store.advance = spy  # type: ignore[method-assign]
    _run(cfg, FakeSteps(registry, store), store)
    assert states == [
        RoundState.SNAPSHOT,
        RoundState.TRAIN,
        RoundState.EVALUATE,
        RoundState.GATE,
        RoundState.REGISTER,
        RoundState.PROMOTE,
        RoundState.DONE,
    ]


def test_no_winner_is_logged_and_ends_as_no_winner(cfg, tmp_path) -> None:
    store, registry = RoundStore(tmp_path), FakeRegistry()
    final = _run(cfg, FakeSteps(registry, store, winner=False), store)
    assert final.state is RoundState.NO_WINNER and final.reason.startswith(f"{MODEL}: keep base: no candidate passed")
    assert registry.alias_moves == [] and final.versions == {}


def test_a_trainer_without_an_evaluate_boundary_still_passes_evaluate_and_gate(cfg, tmp_path) -> None:
    store, registry = RoundStore(tmp_path), FakeRegistry()
    steps = FakeSteps(registry, store)
    real = steps.train_and_evaluate
    steps.train_and_evaluate = lambda record, table, on_phase: real(record, table, lambda b: None)  # type: ignore[method-assign]
    final = _run(cfg, steps, store)
    assert final.state is RoundState.DONE and registry.alias_moves == [(MODEL, "1")]


def test_too_few_rows_end_at_snapshot_as_no_winner(cfg, tmp_path) -> None:
    store = RoundStore(tmp_path)
    steps = FakeSteps(FakeRegistry(), store, rows=1)
    final = _run(cfg, steps, store)
    assert final.state is RoundState.NO_WINNER and "only 1 row(s)" in final.reason and steps.seen == []


@pytest.mark.parametrize(
    ("error", "state"),
    [
        (NotEnoughDataError("the held-out table is empty; widen the window"), RoundState.NO_WINNER),
        (DataError("row 't1': prompt is not JSON"), RoundState.FAILED),  # unreadable data is a failure
    ],
)
def test_not_enough_data_in_training_ends_as_no_winner_not_failed(cfg, tmp_path, caplog, error, state) -> None:
    """The default hourly round on a fresh stack (too little feedback for its reward model) used to fail with a
    traceback in the log; it now ends no_winner, its reason saying what is missing, and logs no traceback."""
    store, registry = RoundStore(tmp_path), FakeRegistry()
    steps = FakeSteps(registry, store)

    def train_and_evaluate(record, table, on_phase):
        raise error

    steps.train_and_evaluate = train_and_evaluate  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="pipeline.rounds.job"):
        final = _run(cfg, steps, store)
    assert final.state is state and str(error) in final.reason and registry.alias_moves == []
    tracebacks = [r for r in caplog.records if r.exc_info]
    if state is RoundState.NO_WINNER:
        assert final.reason == f"not enough data: {error}" and tracebacks == []
    else:
        assert final.reason.startswith("train: DataError") and tracebacks


def test_not_enough_data_after_evaluate_began_fails_the_round_consistently(cfg, tmp_path) -> None:
    """evaluate cannot move to no_winner: the round ends failed (a terminal state), never stuck in evaluate."""
    store, registry = RoundStore(tmp_path), FakeRegistry()
    steps = FakeSteps(registry, store)

    def train_and_evaluate(record, table, on_phase):
        on_phase(PhaseBoundary(RoundPhase.EVALUATE))  # evaluation starts: the record moves to evaluate
        raise NotEnoughDataError("all held-out rows with feedback are up-votes")

    steps.train_and_evaluate = train_and_evaluate  # type: ignore[method-assign]
    final = _run(cfg, steps, store)
    assert final.state is RoundState.FAILED and final.reason.startswith("evaluate: not enough data: all held-out rows")


def test_not_enough_data_in_promote_fails_the_round_and_never_reads_no_winner(cfg, tmp_path) -> None:
    """A hostile-input pass: promote may move to no_winner (no decision had a winner), so a not-enough-data error
    there read as no_winner although the alias had moved. Only snapshot and train end no_winner for it."""
    store, registry = RoundStore(tmp_path), FakeRegistry()
    steps = FakeSteps(registry, store)
    real = steps.promote

    def promote(record):
        real(record)
        raise NotEnoughDataError("x")

    steps.promote = promote  # type: ignore[method-assign]
    final = _run(cfg, steps, store)
    assert final.state is RoundState.FAILED and final.reason == "promote: not enough data: x"


@pytest.mark.parametrize(
    ("at", "reason"),
    [
        ("train:1", "cancelled during train (before train step 1)"),
        ("evaluate:greedy", "cancelled during evaluate (before greedy)"),
        ("evaluate:score:default", "cancelled during evaluate (before score of default)"),
    ],
)
def test_a_cancel_lands_at_the_next_boundary(cfg, tmp_path, at: str, reason: str) -> None:
    store, registry = RoundStore(tmp_path), FakeRegistry()
    steps = FakeSteps(registry, store)
    runner = RoundRunner(cfg, "f" * 64, store=store, steps=steps)
    steps.on_boundary = lambda b: runner.cancel() if b == at else None
    record = runner.start("manual")
    assert runner.wait(10)
    final = store.get(record.round_id)
    assert final.state is RoundState.CANCELLED and final.reason == reason and registry.alias_moves == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize(
    ("die_at", "died_in"),
    [("snapshot", RoundState.SNAPSHOT), ("train", RoundState.TRAIN), ("evaluate", RoundState.EVALUATE)],
)
def test_a_crash_before_register_fails_the_round_and_unloads_its_adapters(
    cfg, tmp_path, die_at: str, died_in: RoundState
) -> None:
    store, registry = RoundStore(tmp_path), FakeRegistry()
    dead = _run(cfg, FakeSteps(registry, store, die_at=die_at), store)
    assert dead.state is died_in
    steps = FakeSteps(registry, store)
    [settled] = recover(cfg, store, steps=steps)
    assert (
        settled.state is RoundState.FAILED
        and f"died during {died_in}" in settled.reason
        and "nothing was registered" in settled.reason
    )
    assert "unloaded 1 adapter(s)" in settled.reason and steps.unloaded == [dead.round_id]
    assert registry.versions == {} and registry.alias_moves == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize(
    ("die_at", "died_in"),
    [
        ("register:start", RoundState.REGISTER),  # nothing written yet
        ("register:written-ahead", RoundState.REGISTER),  # pending folder, not registered: recovery registers it
        ("register:registered", RoundState.REGISTER),  # registered, no alias moved: recovery promotes
        ("promote:start", RoundState.PROMOTE),  # promote began, the alias did not move yet
        ("promote:moved", RoundState.PROMOTE),  # the alias moved, the record did not say done yet
    ],
)
def test_a_crash_from_register_on_is_promoted_exactly_once(cfg, tmp_path, die_at: str, died_in: RoundState) -> None:
    store, registry = RoundStore(tmp_path), FakeRegistry()
    dead = _run(cfg, FakeSteps(registry, store, die_at=die_at), store)
    assert dead.state is died_in
    moved_before = list(registry.alias_moves)
    assert moved_before == ([(MODEL, "1")] if die_at == "promote:moved" else [])  # registering alone moved nothing

    steps = FakeSteps(registry, store)
    [settled] = recover(cfg, store, steps=steps)
    if die_at == "register:start":  # it died before anything was written: nothing to promote
        assert settled.state is RoundState.FAILED and "before its result was written" in settled.reason
        assert registry.versions == {} and registry.alias_moves == []
        return
    assert settled.state is RoundState.DONE and settled.versions == {MODEL: "1"}
    assert settled.reason.startswith(
        f"resumed after a restart (process died during {died_in}); registered {{'{MODEL}': '1'}}"
    )
    assert registry.alias_moves == [(MODEL, "1")] and registry.champion == {MODEL: "1"}  # exactly once
    assert recover(cfg, store, steps=FakeSteps(registry, store)) == [] and registry.alias_moves == [
        (MODEL, "1")
    ]  # nothing left to settle
    assert steps.unloaded == []  # a committed round's adapters are the winners': not a leak


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_round_that_died_in_register_waits_while_the_registry_is_down(cfg, tmp_path) -> None:
    store, registry = RoundStore(tmp_path), FakeRegistry()
    dead = _run(cfg, FakeSteps(registry, store, die_at="register:written-ahead"), store)
    registry.reachable = False
    assert recover(cfg, store, steps=FakeSteps(registry, store)) == []
    assert store.get(dead.round_id).state is RoundState.REGISTER and registry.pending == {dead.round_id}
    registry.reachable = True
    [settled] = recover(cfg, store, steps=FakeSteps(registry, store))
    assert settled.state is RoundState.DONE and registry.alias_moves == [(MODEL, "1")]


def test_transitions_are_one_table() -> None:
    order = [
        RoundState.PENDING,
        RoundState.SNAPSHOT,
        RoundState.TRAIN,
        RoundState.EVALUATE,
        RoundState.GATE,
        RoundState.REGISTER,
        RoundState.PROMOTE,
        RoundState.DONE,
    ]
    for here, there in zip(order, order[1:]):
        assert check_transition(here, there) is there
    for state in RoundState:
        assert state.terminal == (
            state in (RoundState.DONE, RoundState.NO_WINNER, RoundState.FAILED, RoundState.CANCELLED)
        )
        if not state.terminal:
            assert {RoundState.FAILED, RoundState.CANCELLED} <= TRANSITIONS[state]
    with pytest.raises(IllegalTransitionError, match="cannot move from 'train' to 'register'"):
        check_transition("train", "register")
    with pytest.raises(IllegalTransitionError):
        check_transition(RoundState.DONE, RoundState.PROMOTE)
    with pytest.raises(UnknownStateError, match="'exploded'"):
        check_transition("train", "exploded")


def test_records_written_before_gate_existed_still_load(tmp_path) -> None:
    store = RoundStore(tmp_path)
    record = store.create("manual", ["default"], "1h")
    old_body = {**record.as_dict(), "state": "register", "versions": {MODEL: "3"}}  # as an older release stored it
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE rounds SET state = ?, body = ? WHERE round_id = ?",
            ("register", json.dumps(old_body), record.round_id),
        )
    loaded = store.get(record.round_id)
    assert loaded.state is RoundState.REGISTER and loaded.versions == {MODEL: "3"}
    assert [r.round_id for r in store.unfinished()] == [record.round_id]
