"""Round records: the persisted state machine of every round, and the lock
that keeps two rounds from running at once.

States::

    pending → snapshot → train → evaluate → register → promote → done
                                                            ↘ no_winner
    any non-terminal state → failed | cancelled

Records live in SQLite (``<state_dir>/rounds.sqlite``, SQLAlchemy core), one
row per round, updated at every transition, so a restart after a crash can
see where a round stopped (:func:`recover`). Credentials in URIs (a failure
reason naming the MLflow server) are redacted before a record is stored. The lock is an ``flock`` on
``<state_dir>/round.lock``: it holds across processes that share the state
directory and is released by the kernel when a process dies.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from pipeline.errors import PipelineError
from pipeline.redact import redact_data

STATES = ("pending", "snapshot", "train", "evaluate", "register", "promote")
TERMINAL = ("done", "no_winner", "failed", "cancelled")


class RoundInProgressError(PipelineError, RuntimeError):
    """A round is already running (in this process or another one)."""


class UnknownRoundError(PipelineError, KeyError):
    """No round with that id."""


@dataclass
class RoundRecord:
    """One round as stored; ``metrics`` and ``decisions`` are JSON-able dicts."""

    round_id: str
    state: str
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

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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

    def create(self, trigger: str, candidates: list[str], window: str, round_id: str | None = None) -> RoundRecord:
        """Persist a new ``pending`` round (``round_id`` defaults to :meth:`new_round_id`)."""
        now = _now()
        record = RoundRecord(round_id or self.new_round_id(), "pending", trigger, candidates, window, now, now)
        with self.engine.begin() as conn:
            conn.execute(_rounds.insert().values(round_id=record.round_id, state=record.state, created_at=now, body=json.dumps(redact_data(record.as_dict()))))
        return record

    def save(self, record: RoundRecord) -> RoundRecord:
        record.updated_at = _now()
        if record.terminal and record.finished_at is None:
            record.finished_at = record.updated_at
        with self.engine.begin() as conn:
            conn.execute(
                _rounds.update().where(_rounds.c.round_id == record.round_id).values(state=record.state, body=json.dumps(redact_data(record.as_dict()), default=str))
            )
        return record

    def transition(self, record: RoundRecord, state: str, reason: str | None = None) -> RoundRecord:
        """Move a round to ``state`` (and persist it at once)."""
        if state not in STATES + TERMINAL:
            raise ValueError(f"unknown round state {state!r}")
        record.state = state
        if reason is not None:
            record.reason = reason
        return self.save(record)

    def get(self, round_id: str) -> RoundRecord:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(_rounds.c.body).where(_rounds.c.round_id == round_id)).first()
        if row is None:
            raise UnknownRoundError(f"no round {round_id!r}")
        return RoundRecord(**json.loads(row[0]))

    def list(self, limit: int = 50) -> list[RoundRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(_rounds.c.body).order_by(_rounds.c.created_at.desc()).limit(limit)).all()
        return [RoundRecord(**json.loads(r[0])) for r in rows]

    def unfinished(self) -> list[RoundRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(_rounds.c.body).where(_rounds.c.state.in_(STATES))).all()
        return [RoundRecord(**json.loads(r[0])) for r in rows]


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
