"""Round records, the cross-process round lock, and crash recovery of records."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.rounds.job import parse_window, recover
from pipeline.rounds.records import RoundInProgressError, RoundLock, RoundStore


def test_records_persist_every_transition(tmp_path: Path) -> None:
    store = RoundStore(tmp_path)
    record = store.create("manual", ["a", "b"], "6h")
    assert record.state == "pending" and record.round_id.startswith("r")
    store.transition(record, "snapshot")
    store.transition(record, "train")
    again = RoundStore(tmp_path).get(record.round_id)  # a new process would see this
    assert again.state == "train" and again.candidates == ["a", "b"] and again.finished_at is None
    store.transition(record, "failed", "boom")
    final = RoundStore(tmp_path).get(record.round_id)
    assert final.state == "failed" and final.reason == "boom" and final.finished_at is not None
    assert [r.round_id for r in store.unfinished()] == []
    with pytest.raises(ValueError):
        store.transition(record, "exploded")


def test_lock_refuses_a_second_holder_in_another_process(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import time
            from pipeline.rounds.records import RoundLock
            lock = RoundLock({str(tmp_path)!r}); lock.acquire("r-other")
            print("held", flush=True); time.sleep(60)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RoundInProgressError, match="r-other"):
            RoundLock(tmp_path).acquire("r-mine")
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    lock = RoundLock(tmp_path)  # the kernel released the dead holder's lock
    lock.acquire("r-mine")
    with pytest.raises(RoundInProgressError, match="r-mine"):  # and now we hold it
        RoundLock(tmp_path).acquire("r-third")
    lock.release()
    RoundLock(tmp_path).acquire("r-after-release")


def test_recover_marks_rounds_interrupted_before_register_as_failed(tmp_path: Path) -> None:
    cfg = load_config(None).model_copy(update={"state_dir": str(tmp_path)})
    store = RoundStore(tmp_path)
    record = store.create("schedule", ["default"], "1h")
    store.transition(record, "train")
    settled = recover(cfg, store)
    assert [r.round_id for r in settled] == [record.round_id]
    after = store.get(record.round_id)
    assert after.state == "failed" and "died during train" in after.reason and "nothing was registered" in after.reason


def test_parse_window() -> None:
    assert parse_window("6h").total_seconds() == 6 * 3600
    assert parse_window("2d").days == 2
    for bad in ("6", "h", "1w", "-1h", "1.5h"):
        with pytest.raises(ValueError):
            parse_window(bad)
