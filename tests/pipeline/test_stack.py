"""`hourglass up` / `hourglass down` on real services, as an operator runs them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.stack import free_port

pytestmark = pytest.mark.integration


def _config(tmp_path: Path, model: Path) -> Path:
    kafka, mlflow, vllm = free_port(), free_port(), free_port()
    conf = tmp_path / "hourglass.toml"
    conf.write_text(
        f"""
state_dir = "{tmp_path / "state"}"
[kafka]
bootstrap_servers = ["127.0.0.1:{kafka}"]
[registry]
tracking_uri = "http://127.0.0.1:{mlflow}"
[model]
name = "{model}"
[serving]
replicas = ["http://127.0.0.1:{vllm}"]
max_model_len = 512
"""
    )
    return conf


def _hourglass(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, timeout=timeout, env=os.environ
    )


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_reports_every_service_healthy_then_down_leaves_no_process(tmp_path: Path, tiny_model: Path) -> None:
    conf = _config(tmp_path, tiny_model)
    up = _hourglass("up", "--config", str(conf), "--json")
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        rows = json.loads(up.stdout)
        assert {r["service"] for r in rows} == {"broker", "mlflow", "vllm"}
        assert all(r["healthy"] for r in rows), rows
        pids = [r["pid"] for r in rows]

        again = _hourglass("up", "--config", str(conf), "--json")  # idempotent: nothing restarted
        assert again.returncode == 0
        assert [r["pid"] for r in json.loads(again.stdout)] == pids

        health = _hourglass("health", "--config", str(conf), "--json")
        assert health.returncode == 0 and all(r["healthy"] for r in json.loads(health.stdout))
    finally:
        down = _hourglass("down", "--config", str(conf), "--json")
    assert down.returncode == 0, down.stderr
    assert sorted(json.loads(down.stdout)["stopped"]) == ["broker", "mlflow", "vllm"]
    # Each service ran as its own process group: no member (vLLM's engine core,
    # MLflow's workers) may outlive `down`.
    assert not [pid for pid in pids if _alive(pid)]
    health = _hourglass("health", "--config", str(conf), "--json")
    assert health.returncode == 1 and not any(r["healthy"] for r in json.loads(health.stdout))


def test_up_refuses_a_taken_port_with_a_clear_message(tmp_path: Path, tiny_model: Path) -> None:
    conf = _config(tmp_path, tiny_model)
    port = int(conf.read_text().split("127.0.0.1:")[1].split('"')[0])  # the broker's
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        up = _hourglass("up", "--config", str(conf), timeout=120)
    assert up.returncode == 1
    assert f"port 127.0.0.1:{port} is already in use" in up.stderr
    down = _hourglass("down", "--config", str(conf), "--json")
    assert json.loads(down.stdout)["stopped"] == []


def test_a_healthy_process_whose_log_says_a_plugin_failed_is_a_failed_start(tmp_path: Path) -> None:
    """vLLM answers health checks even when an Hourglass plugin failed to load (e.g. a stale install); the
    start fails instead, naming the line and what to do, and the process is stopped. A later clean start
    of the same service (same log file, appended) is not blamed for the earlier start's line."""
    from pipeline.stack import Service, StackError

    def service(line: str) -> Service:
        code = f"print({line!r}, flush=True); import time; time.sleep(120)"
        fatal = {"Failed to load plugin hourglass_": "reinstall"}
        return Service(
            "fake",
            [sys.executable, "-c", code],
            "127.0.0.1",
            free_port(),
            lambda: True,
            tmp_path,
            startup_timeout_s=30,
            fatal_log_lines=fatal,
        )

    broken = service("ERROR Failed to load plugin hourglass_grouped_cpu_lora")
    broken.health = lambda: "Failed" in broken.log_path.read_text()  # healthy once the line is written
    with pytest.raises(StackError, match="Failed to load plugin hourglass_.*reinstall"):
        broken.start()
    assert broken.process is not None and broken.process.poll() is not None  # stopped
    clean = service("INFO grouped CPU LoRA kernels installed")
    clean.health = lambda: "installed" in clean.log_path.read_text()
    clean.start()
    try:
        assert clean.process is not None and clean.process.poll() is None
    finally:
        clean.stop()
