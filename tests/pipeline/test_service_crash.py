"""The always-on service on real Kafka, MLflow and vLLM: manual retrain through
the CLI, a refused second trigger, and a SIGKILL in the middle of a round.

After the kill and a restart: the round is settled as failed, nothing was
registered or promoted, and ingestion resumes with every acknowledged trace in
the buffer exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient

from connectors.buffer import RewardBuffer
from connectors.kafka_admin import ensure_topics
from connectors.schema import TraceEvent
from connectors.sink import TraceSink
from pipeline.config import load_config
from pipeline.stack import free_port, stop_group, tail
from pipeline.demo.traffic import arithmetic_questions

pytestmark = pytest.mark.integration


def _write_config(tmp_path: Path, broker: str, mlflow_uri: str, vllm_url: str, model: Path, steps: int) -> Path:
    suffix = uuid.uuid4().hex[:8]
    conf = tmp_path / "hourglass.toml"
    conf.write_text(
        f"""
state_dir = "{tmp_path / "state"}"
[kafka]
bootstrap_servers = ["{broker}"]
embedded = false
traces_topic = "svc.traces.{suffix}"
feedback_topic = "svc.feedback.{suffix}"
group_id = "svc-{suffix}"
partitions = 2
[buffer]
root = "{tmp_path / "buffer"}"
dead_letter_root = "{tmp_path / "dlq"}"
[model]
name = "{model}"
[[candidates]]
name = "slow"
learning_rate = 1e-3
lora_rank = 4
lora_alpha = 8
reward = [{{ fn = "format", weight = 1.0 }}]
[rl]
steps_per_round = {steps}
prompts_per_step = 2
adapter_store = "offload"
window = "1d"

[rl.rollout]
group_size = 2
max_new_tokens = 4
engine = "hf"

[rl.gate]
eval_prompts = 4
[schedule]
enabled = false
[registry]
tracking_uri = "{mlflow_uri}"
embedded = false
experiment = "svc-{suffix}"
[serving]
model_name = "svc-{suffix}"
replicas = ["{vllm_url}"]
embedded = false
reconcile_interval_s = 2
[api]
port = {free_port()}
"""
    )
    return conf


def _produce(cfg, n: int, seed: int) -> set[str]:
    ids = set()
    with TraceSink(cfg.kafka) as sink:
        for i, (question, reference) in enumerate(arithmetic_questions(n, seed)):
            trace_id = f"t{seed}-{i}"
            event = TraceEvent(
                trace_id=trace_id,
                ts=datetime.now(timezone.utc),
                model=cfg.serving.model_name,
                prompt=[{"role": "user", "content": question}],
                completion=reference,
                reward=1.0,
                metadata={"reference_answer": reference},
            )
            sink.send_trace(event)
            ids.add(trace_id)
        assert sink.flush() == len(ids)  # every record acknowledged by the broker
    return ids


def _hourglass(conf: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args, "--config", str(conf)],
        capture_output=True,
        text=True,
        timeout=120,
    )


class _Service:
    def __init__(self, conf: Path, api: str, log: Path) -> None:
        self.conf, self.api, self.log = conf, api, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "service", "--config", str(self.conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=os.environ,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, tail(self.log)
            try:
                if httpx.get(f"{self.api}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"service did not start:\n{tail(self.log)}")

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_group(self.proc.pid)

    def wait_for(self, predicate, what: str, timeout_s: float = 180):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        pytest.fail(f"timed out waiting for {what}\n{tail(self.log)}")


def _round(api: str, round_id: str) -> dict:
    return httpx.get(f"{api}/rounds/{round_id}", timeout=10).json()


def test_sigkill_mid_round_then_restart(
    tmp_path: Path, broker: str, mlflow_uri: str, vllm_tiny: str, tiny_model: Path
) -> None:
    conf = _write_config(tmp_path, broker, mlflow_uri, vllm_tiny, tiny_model, steps=500)
    cfg = load_config(conf)
    ensure_topics(cfg.kafka)
    api = f"http://127.0.0.1:{cfg.api.port}"
    service = _Service(conf, api, tmp_path / "service.log")
    sent = _produce(cfg, 24, seed=1)
    service.start()
    try:
        buffer = RewardBuffer(cfg.buffer)
        service.wait_for(lambda: buffer.snapshot().num_rows >= len(sent), "the first traces in the buffer")

        started = _hourglass(conf, "retrain", "--json")  # manual retrain through the CLI
        assert started.returncode == 0, started.stderr
        round_id = json.loads(started.stdout)["round_id"]
        again = _hourglass(conf, "retrain")
        assert again.returncode == 1 and "already running" in again.stderr
        assert [r["round_id"] for r in httpx.get(f"{api}/rounds", timeout=10).json()] == [
            round_id
        ]  # the refusal left no record
        service.wait_for(lambda: _round(api, round_id)["state"] == "train", "the round to reach train")
        time.sleep(2)
        service.kill()  # SIGKILL mid-round: no shutdown code runs

        sent |= _produce(cfg, 16, seed=2)  # traffic keeps coming while the service is down
        service.start()
        settled = _round(api, round_id)
        assert settled["state"] == "failed" and "died during train" in settled["reason"]
        assert MlflowClient(mlflow_uri).search_model_versions(f"name = '{cfg.serving.model_name}'") == []
        assert not (cfg.resolve(cfg.state_dir) / "routes.json").exists()  # the base still serves

        def all_ingested():
            table = RewardBuffer(cfg.buffer).snapshot()
            return table if set(table.column("trace_id").to_pylist()) >= sent else None

        table = service.wait_for(all_ingested, "ingestion to resume")
        ids = table.column("trace_id").to_pylist()
        assert len(ids) == len(set(ids)) == len(sent)  # exactly once, nothing lost

        status = _hourglass(conf, "status", "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["round_running"] is None
        listed = json.loads(_hourglass(conf, "rounds", "list", "--json").stdout)
        assert [r["round_id"] for r in listed if r["state"] == "failed"] == [round_id]
    finally:
        service.stop()
