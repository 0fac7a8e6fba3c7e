"""The always-on service and the Ray executor's trainer actors: the service keeps them between rounds,
starts them in the background at its start and again after every round (so a failed round's actors
are re-created before the next one), a round starts them before its snapshot, a cluster that does
not answer is logged instead of failing the service, and shutdown frees them. The cluster is a stand-in here (the pool itself is tested on real Ray in
tests/trainer/test_ray_executor.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.service import HourglassService
from trainer.executors import ray_pool
from trainer.errors import ExecutorUnavailableError


class _BufferDown:
    """Round steps whose snapshot fails: the round ends ``failed``."""

    def buffer_rows(self) -> int:
        return 0

    def snapshot(self, window: str, until=None):
        raise OSError("buffer unreachable")

    def unload(self, round_id: str, candidates: list[str]) -> dict:
        return {}


def _cfg(tmp_path: Path, executor: str = "local", keep_actors: bool | None = None):
    cfg = load_config(None)
    ray = cfg.rl.ray.model_copy(update={"keep_actors": keep_actors})
    return cfg.model_copy(
        update={"state_dir": str(tmp_path), "rl": cfg.rl.model_copy(update={"executor": executor, "ray": ray})}
    )


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_service_keeps_its_trainer_actors_and_warms_them_at_start_and_after_each_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple] = []
    released: list[bool] = []
    monkeypatch.setattr(
        ray_pool, "warm", lambda rl, model, n: calls.append((rl.ray.keep_actors, model.name, n)) or True
    )
    monkeypatch.setattr(ray_pool, "release_kept_actors", lambda: released.append(True))
    cfg = _cfg(tmp_path, executor="ray")
    assert cfg.rl.ray.keep_actors is None
    service = HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)
    assert service.cfg.rl.ray.keep_actors is True and service.runner.cfg.rl.ray.keep_actors is True

    thread = service.warm_trainers()  # what start() does
    assert thread is not None
    thread.join(5)
    assert calls == [(True, cfg.model.name, len(cfg.candidates))]

    service.runner.steps = _BufferDown()  # type: ignore[assignment]
    record = service.runner.run("manual")
    assert record.state == "failed" and "buffer unreachable" in record.reason
    _until(lambda: len(calls) == 3)
    # the round started them itself before its snapshot (a no-op when kept ones fit), then they were warmed again
    assert calls == [(True, cfg.model.name, len(cfg.candidates))] * 3

    service.shutdown(round_grace_s=1)
    assert released == [True]
    assert service.warm_trainers() is None and len(calls) == 3  # none after shutdown


def test_no_warm_up_for_local_rounds_or_without_kept_actors_and_a_dead_cluster_is_only_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert (
        HourglassService(_cfg(tmp_path / "a"), base_fingerprint="f" * 64, ingest=False, reconcile=False).warm_trainers()
        is None
    )
    off = HourglassService(
        _cfg(tmp_path / "b", executor="ray", keep_actors=False),
        base_fingerprint="f" * 64,
        ingest=False,
        reconcile=False,
    )
    assert off.cfg.rl.ray.keep_actors is False and off.warm_trainers() is None

    def unreachable(rl, model, n):
        raise ExecutorUnavailableError("Ray cluster at rl.ray.address='10.0.0.9:6379' is unreachable")

    monkeypatch.setattr(ray_pool, "warm", unreachable)
    service = HourglassService(
        _cfg(tmp_path / "c", executor="ray"), base_fingerprint="f" * 64, ingest=False, reconcile=False
    )
    with caplog.at_level(logging.WARNING, logger="pipeline.service"):
        thread = service.warm_trainers()
        assert thread is not None
        thread.join(5)
    assert not thread.is_alive()
    assert "could not start the trainer actors ahead of the next round" in caplog.text and "unreachable" in caplog.text
