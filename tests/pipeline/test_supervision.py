"""Supervised workers: a worker that raises is restarted with backoff, counted,
and shown in /readyz and /status while it waits; the scheduler is re-created
when its thread dies; `hourglass up --watch` restarts a dead service."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from pipeline.api import create_api
from pipeline.config import load_config
from pipeline.service import HourglassService
from pipeline.stack import Service, free_port, http_ok, running_pid, stop_group, watch
from pipeline.supervise import Worker


def _restarts(worker: str) -> float:
    return REGISTRY.get_sample_value("hourglass_worker_restarts_total", {"worker": worker}) or 0.0


def _wait(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_a_worker_that_raises_is_restarted_with_growing_backoff() -> None:
    starts: list[float] = []

    def flaky(stop: threading.Event) -> None:
        starts.append(time.monotonic())
        if len(starts) <= 3:
            raise OSError(f"boom {len(starts)}")
        stop.wait()

    before = _restarts("flaky")
    worker = Worker("flaky", flaky, initial_s=0.1, max_s=0.25)
    worker.start()
    try:
        _wait(lambda: len(starts) == 4 and worker.alive)
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert gaps[0] >= 0.09 and gaps[1] >= 0.19 and 0.24 <= gaps[2] < 1.0  # 0.1, 0.2, then capped at 0.25
        state = worker.state()
        assert state.state == "running" and state.restarts == 3 and state.last_error == "OSError: boom 3"
        assert _restarts("flaky") - before == 3
    finally:
        assert worker.stop(5)
    assert worker.state().state == "stopped" and not worker.alive


def test_a_stop_request_interrupts_the_backoff() -> None:
    worker = Worker("dead", lambda stop: (_ for _ in ()).throw(RuntimeError("always")), initial_s=30, max_s=30)
    worker.start()
    _wait(lambda: worker.state().state == "restarting")
    assert not worker.alive and worker.state().next_restart_in_s > 20
    started = time.monotonic()
    assert worker.stop(5) and time.monotonic() - started < 2


@pytest.fixture
def service(tmp_path: Path):
    cfg = load_config(None).model_copy(update={"state_dir": str(tmp_path)})
    svc = HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)
    yield svc
    svc.shutdown(round_grace_s=1)


def test_dead_worker_shows_in_readyz_and_status_then_recovers(service: HourglassService) -> None:
    service.start()
    calls: list[int] = []

    def poisoned(stop: threading.Event) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("poison record")
        stop.wait()

    worker = Worker("ingest", poisoned, initial_s=1.5, max_s=1.5)
    service.workers["ingest"] = worker
    worker.start()
    client = TestClient(create_api(service), base_url="http://localhost")  # Host must name the API
    _wait(lambda: worker.state().state == "restarting")
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["ingest"] is False
    assert ready.json()["checks"]["scheduler"] is True
    status = client.get("/status").json()["workers"]["ingest"]
    assert status["state"] == "restarting" and status["restarts"] == 1 and "poison record" in status["last_error"]
    _wait(lambda: worker.alive, timeout_s=5)
    _wait(lambda: client.get("/readyz").json()["checks"]["ingest"] is True, timeout_s=8)  # /readyz is cached ~2 s
    assert 'hourglass_worker_restarts_total{worker="ingest"}' in client.get("/metrics").text


def test_scheduler_whose_thread_dies_is_recreated(service: HourglassService) -> None:
    service.start()
    first = service.scheduler
    assert first is not None and first.running
    before = _restarts("scheduler")
    first.shutdown(wait=False)  # the APScheduler thread stops on its own
    _wait(lambda: service.scheduler is not first and service.scheduler.running, timeout_s=10)
    assert _restarts("scheduler") - before == 1
    assert service.scheduler.get_job("retry-pending") is not None
    assert service.readiness()["scheduler"] is True


@pytest.mark.integration  # starts a stand-in service process (http.server) and kills it
def test_up_watch_restarts_a_dead_service(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    svc = Service("web", argv, "127.0.0.1", port, http_ok(f"http://127.0.0.1:{port}/"), tmp_path, startup_timeout_s=20)
    svc.start()
    stop = threading.Event()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(watch([svc], stop, every_s=0.2)))
    thread.start()
    try:
        first = running_pid(svc)
        stop_group(first, grace_s=2)  # it crashes
        _wait(lambda: (pid := running_pid(svc)) is not None and pid != first and svc.health(), timeout_s=20)
    finally:
        stop.set()
        thread.join(10)
        svc.stop(grace_s=2)
    assert result == {"web": 1}


def test_canary_monitor_is_a_supervised_worker(service: HourglassService, monkeypatch: pytest.MonkeyPatch) -> None:
    """The canary loop runs under the same supervision as the other workers: a look that raises is
    restarted with backoff and shows in /status and /readyz meanwhile; shutdown stops it."""
    from pipeline.canary import monitor as canary_monitor

    looks: list[float] = []

    def flaky_look(self) -> dict:
        looks.append(time.monotonic())
        if len(looks) == 1:
            raise RuntimeError("registry answered garbage")
        return {}

    monkeypatch.setattr(canary_monitor, "make_client", lambda cfg: object())  # no MLflow needed: the look is replaced
    monkeypatch.setattr(canary_monitor.CanaryMonitor, "check_once", flaky_look)
    service.start()
    before = _restarts("canary")
    service._start_canary(["hourglass"])
    worker = service.workers["canary"]
    client = TestClient(create_api(service), base_url="http://localhost")
    status = _wait(
        lambda: (s := client.get("/status").json()["workers"].get("canary")) and s["state"] == "restarting" and s
    )
    assert status["restarts"] == 1 and "registry answered garbage" in status["last_error"]
    _wait(lambda: len(looks) >= 2 and worker.alive, timeout_s=5)  # restarted after the 1 s backoff
    assert looks[1] - looks[0] >= 0.9 and _restarts("canary") - before == 1
    assert service.readiness()["canary"] is True
    service.shutdown(round_grace_s=1)
    assert worker.state().state == "stopped"
