"""Round records: the persisted state machine of every round, and the lock
that keeps two rounds from running at once.

States (:class:`RoundState`; the allowed moves are :data:`TRANSITIONS`, nowhere else)::

    pending → snapshot → train → evaluate → gate → register → promote → done
                  ↘ no_winner (too few rows)                        ↘ no_winner
                             train ↘ no_winner (not enough data: no held-out rows, no candidate with
                                                training prompts, too little feedback for the reward model
                                                every candidate needs; a candidate with no prompts or no
                                                reward model beside others that can train is ``skipped``)
    any non-terminal state → failed | cancelled

- ``snapshot``: the buffer's rows of the window are read;
- ``train``: the reward model (when wanted) and every candidate train;
- ``evaluate``: candidates and champions answer the same held-out prompts;
- ``gate``: the gate's decisions are recorded (one per served model);
- ``register``: the round and its winners are written to MLflow; no alias moves;
- ``promote``: each winner's alias moves (``@champion``, or ``@challenger`` with the canary on).

Records live in SQLite (``<state_dir>/rounds.sqlite``, SQLAlchemy core), one
row per round, updated at every transition, so a restart after a crash can
see where a round stopped (:func:`pipeline.rounds.job.recover`). Credentials in
URIs (a failure reason naming the MLflow server) are redacted before a record
is stored. The lock is an ``flock`` on ``<state_dir>/round.lock``: it holds
across processes that share the state directory and is released by the kernel
when a process dies.
"""

from __future__ import annotations

import builtins
import fcntl
import json
import os
import uuid
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from pipeline.errors import PipelineError
from pipeline.redact import redact_data


class UnknownStateError(PipelineError, ValueError):
    """A state name that is not a :class:`RoundState`."""


class IllegalTransitionError(PipelineError, ValueError):
    """A move the state machine does not allow (see :data:`TRANSITIONS`)."""


class RoundState(StrEnum):
    """Where a round is. The values are what records, the API and the CLI show."""

    PENDING = "pending"
    SNAPSHOT = "snapshot"
    TRAIN = "train"
    EVALUATE = "evaluate"
    GATE = "gate"
    REGISTER = "register"
    PROMOTE = "promote"
    DONE = "done"
    NO_WINNER = "no_winner"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @classmethod
    def parse(cls, name: str) -> RoundState:
        """The state called ``name`` (as stored in a record).

        Raises:
            UnknownStateError: no such state.
        """
        try:
            return cls(name)
        except ValueError:
            raise UnknownStateError(f"unknown round state {name!r}; known: {[s.value for s in cls]}") from None

    @property
    def terminal(self) -> bool:
        """True for ``done``, ``no_winner``, ``failed`` and ``cancelled``."""
        return not TRANSITIONS[self]

    @property
    def committed(self) -> bool:
        """True from ``register`` on: the result may be in MLflow, so the round is finished, never dropped."""
        return self in (RoundState.REGISTER, RoundState.PROMOTE)


_STOP = frozenset({RoundState.FAILED, RoundState.CANCELLED})

TRANSITIONS: dict[RoundState, frozenset[RoundState]] = {
    RoundState.PENDING: frozenset({RoundState.SNAPSHOT}) | _STOP,
    RoundState.SNAPSHOT: frozenset({RoundState.TRAIN, RoundState.NO_WINNER}) | _STOP,  # no_winner: too few rows
    RoundState.TRAIN: frozenset({RoundState.EVALUATE, RoundState.NO_WINNER}) | _STOP,  # no_winner: not enough data
    RoundState.EVALUATE: frozenset({RoundState.GATE}) | _STOP,
    RoundState.GATE: frozenset({RoundState.REGISTER}) | _STOP,  # the round is logged in MLflow even without a winner
    RoundState.REGISTER: frozenset({RoundState.PROMOTE}) | _STOP,
    RoundState.PROMOTE: frozenset({RoundState.DONE, RoundState.NO_WINNER}) | _STOP,
    RoundState.DONE: frozenset(),
    RoundState.NO_WINNER: frozenset(),
    RoundState.FAILED: frozenset(),
    RoundState.CANCELLED: frozenset(),
}
"""Every allowed move of a round, and the only place they are written down."""

STATES = tuple(s for s in RoundState if not s.terminal)
TERMINAL = tuple(s for s in RoundState if s.terminal)


def check_transition(current: RoundState | str, target: RoundState | str) -> RoundState:
    """``target`` as a :class:`RoundState` when the machine may move there from ``current``.

    Raises:
        UnknownStateError: either name is not a state.
        IllegalTransitionError: the move is not in :data:`TRANSITIONS`.
    """
    source, goal = RoundState.parse(current), RoundState.parse(target)
    if goal not in TRANSITIONS[source]:
        allowed = sorted(s.value for s in TRANSITIONS[source])
        raise IllegalTransitionError(
            f"a round cannot move from {source.value!r} to {goal.value!r}; from {source.value!r} it may go to {allowed}"
        )
    return goal


class RoundInProgressError(PipelineError, RuntimeError):
    """A round is already running (in this process or another one)."""


class UnknownRoundError(PipelineError, KeyError):
    """No round with that id."""


@dataclass
class RoundRecord:
    """One round as stored; ``metrics`` and ``decisions`` are JSON-able dicts."""

    round_id: str
    state: RoundState
    trigger: str  # "schedule" | "manual" | "api"
    candidates: list[str]
    window: str
    created_at: str
    updated_at: str
    finished_at: str | None = None
    reason: str = ""
    versions: dict[str, str] = field(default_factory=dict)  # served model -> registered version
    decisions: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # candidates that sat the round out -> why
    until: str | None = None  # the window's end (ISO 8601, UTC) for a replay of a past window; None: the round's start

    def __post_init__(self) -> None:
        self.state = RoundState.parse(self.state)
        # a record edited by hand: anything but a mapping names no candidate (the API, the CLI and the demo read it)
        skipped: Any = self.skipped
        self.skipped = {str(k): str(v) for k, v in skipped.items()} if isinstance(skipped, dict) else {}

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def stored(self) -> str:
        """The record as stored: JSON, secrets redacted; ``until`` only on a replay, so a release from before
        replays still reads every other record."""
        data = redact_data(self.as_dict())
        if data.get("until") is None:
            data.pop("until", None)
        return json.dumps(data, default=str)

    @classmethod
    def from_json(cls, body: str) -> RoundRecord:
        """A record as stored (every record written so far loads: no state was renamed; ``gate`` is new). Keys
        this release does not know (written by a newer one) are left out, so a rollback still reads them."""
        data = json.loads(body)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


_meta = sa.MetaData()
_rounds = sa.Table(
    "rounds",
    _meta,
    sa.Column("round_id", sa.String, primary_key=True),
    sa.Column("state", sa.String, nullable=False),
    sa.Column("created_at", sa.String, nullable=False),
    sa.Column("body", sa.Text, nullable=False),  # the whole record as JSON
)


class RoundStore:
    """Round records in SQLite; safe to share between processes."""

    def __init__(self, state_dir: str | Path) -> None:
        self.state_dir = Path(state_dir).expanduser().resolve()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.engine = sa.create_engine(f"sqlite:///{self.state_dir / 'rounds.sqlite'}", connect_args={"timeout": 30})
        _meta.create_all(self.engine)

    @staticmethod
    def new_round_id() -> str:
        """``r<UTC time>-<6 hex>``: sorts by start time, unique across processes."""
        return f"r{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"

    def create(
        self,
        trigger: str,
        candidates: list[str],
        window: str,
        round_id: str | None = None,
        until: datetime | None = None,
    ) -> RoundRecord:
        """Persist a new ``pending`` round (``round_id`` defaults to :meth:`new_round_id`; ``until``: the end of a
        past window to replay, see :meth:`RoundRecord.until`)."""
        now = _now()
        record = RoundRecord(
            round_id or self.new_round_id(),
            RoundState.PENDING,
            trigger,
            candidates,
            window,
            now,
            now,
            until=until.astimezone(timezone.utc).isoformat() if until is not None else None,
        )
        with self.engine.begin() as conn:
            conn.execute(
                _rounds.insert().values(
                    round_id=record.round_id,
                    state=record.state.value,
                    created_at=now,
                    body=record.stored(),
                )
            )
        return record

    def save(self, record: RoundRecord) -> RoundRecord:
        record.updated_at = _now()
        if record.terminal and record.finished_at is None:
            record.finished_at = record.updated_at
        with self.engine.begin() as conn:
            conn.execute(
                _rounds.update()
                .where(_rounds.c.round_id == record.round_id)
                .values(state=record.state.value, body=record.stored())
            )
        return record

    def advance(self, record: RoundRecord, state: RoundState | str, reason: str | None = None) -> RoundRecord:
        """Move a round to ``state`` along :data:`TRANSITIONS` and persist it at once.

        Raises:
            IllegalTransitionError: the state machine does not allow that move.
            UnknownStateError: ``state`` is not a state.
        """
        return self.transition(record, check_transition(record.state, state), reason)

    def transition(self, record: RoundRecord, state: RoundState | str, reason: str | None = None) -> RoundRecord:
        """Write ``state`` (and ``reason``) into the record without checking the move: for repairs and
        notes on settled records (a terminal record keeps its state and gains a note). Rounds move with :meth:`advance`.

        Raises:
            UnknownStateError: ``state`` is not a state.
        """
        record.state = RoundState.parse(state)
        if reason is not None:
            record.reason = reason
        return self.save(record)

    def get(self, round_id: str) -> RoundRecord:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(_rounds.c.body).where(_rounds.c.round_id == round_id)).first()
        if row is None:
            raise UnknownRoundError(f"no round {round_id!r}")
        return RoundRecord.from_json(row[0])

    def list(self, limit: int = 50) -> list[RoundRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(_rounds.c.body).order_by(_rounds.c.created_at.desc()).limit(limit)).all()
        return [RoundRecord.from_json(r[0]) for r in rows]

    def unfinished(self) -> builtins.list[RoundRecord]:  # (this class's own ``list`` shadows the builtin here)
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(_rounds.c.body).where(_rounds.c.state.in_([s.value for s in STATES]))).all()
        return [RoundRecord.from_json(r[0]) for r in rows]


class RoundLock:
    """An exclusive, non-blocking ``flock`` on ``<state_dir>/round.lock``.

    The holder writes its pid and round id into the file, so a refused caller
    can say who holds it. Released on :meth:`release` or process death.
    """

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir).expanduser().resolve() / "round.lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None

    def acquire(self, round_id: str) -> None:
        """Take the lock for ``round_id``.

        Raises:
            RoundInProgressError: another round holds it (the message names it).
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RoundInProgressError(f"a round is already running ({holder}); wait for it or cancel it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"round {round_id}, pid {os.getpid()}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
