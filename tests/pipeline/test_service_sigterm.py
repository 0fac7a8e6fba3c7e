"""SIGTERM to a real `hourglass service` mid-round (tiny model, real broker,
MLflow and vLLM): the shutdown runs in its documented order and the process
exits 0. Afterwards the round is settled (cancelled, with its reason), the
ingest group has committed every record it stored, and vLLM serves none of
the round's `<candidate>-s<step>` adapters."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import httpx
import pytest
from kafka import KafkaConsumer, TopicPartition

from connectors.buffer import RewardBuffer
from connectors.kafka_admin import ensure_topics
from pipeline.config import load_config
from pipeline.serving.replica import Replica
from pipeline.rounds.records import RoundStore
from pipeline.service import SHUTDOWN_MARKER
from pipeline.stack import tail
from tests.pipeline.test_service_crash import _hourglass, _produce, _round, _Service, _write_config

pytestmark = pytest.mark.integration


def _committed(cfg) -> dict[int, int | None]:
    """Committed offset of the ingest group per partition of the traces topic."""
    probe = KafkaConsumer(
        bootstrap_servers=cfg.kafka.bootstrap_servers, group_id=cfg.kafka.group_id, enable_auto_commit=False
    )
    try:
        return {p: probe.committed(TopicPartition(cfg.kafka.traces_topic, p)) for p in range(cfg.kafka.partitions)}
    finally:
        probe.close(autocommit=False)


def test_sigterm_mid_round_shuts_down_in_order(
    tmp_path: Path, broker: str, mlflow_uri: str, vllm_tiny: str, tiny_model: Path
) -> None:
    conf = _write_config(tmp_path, broker, mlflow_uri, vllm_tiny, tiny_model, steps=500)
    conf.write_text(conf.read_text().replace('engine = "hf"', 'engine = "vllm"'))  # the round publishes into vLLM
    cfg = load_config(conf)
    ensure_topics(cfg.kafka)
    api = f"http://127.0.0.1:{cfg.api.port}"
    service = _Service(conf, api, tmp_path / "service.log")
    sent = _produce(cfg, 24, seed=1)
    service.start()
    published = re.compile(r"^slow-s[0-9]+$")
    try:
        service.wait_for(
            lambda: RewardBuffer(cfg.buffer).snapshot().num_rows >= len(sent), "the first traces in the buffer"
        )
        started = _hourglass(conf, "retrain", "--json")
        assert started.returncode == 0, started.stderr
        round_id = json.loads(started.stdout)["round_id"]
        service.wait_for(
            lambda: any(published.match(n) for n in Replica(vllm_tiny).models()), "the round to publish into vLLM"
        )
        assert _round(api, round_id)["state"] == "train"
        sent |= _produce(cfg, 16, seed=2)
        service.wait_for(
            lambda: RewardBuffer(cfg.buffer).snapshot().num_rows >= len(sent), "the new traces in the buffer"
        )

        service.proc.send_signal(signal.SIGTERM)  # the main process only, as systemd's KillMode=mixed does
        code = service.proc.wait(timeout=cfg.schedule.shutdown_grace_s + 60)
    finally:
        service.stop()
    log = tail(service.log, 400)
    assert code == 0, log
    assert SHUTDOWN_MARKER in log and "SIGTERM" in log

    record = RoundStore(cfg.resolve(cfg.state_dir)).get(round_id)
    assert record.state in ("cancelled", "failed") and record.reason, record
    assert record.state != "cancelled" or record.reason.startswith("cancelled during train"), record.reason

    snap = RewardBuffer(cfg.buffer).snapshot()
    assert sorted(snap.column("trace_id").to_pylist()) == sorted(sent)
    parts, offsets = snap.column("partition").to_pylist(), snap.column("offset").to_pylist()
    stored_next = {p: max(o for q, o in zip(parts, offsets) if q == p) + 1 for p in set(parts)}
    committed = _committed(cfg)  # the shutdown committed everything it had stored, nothing more
    assert {p: o for p, o in committed.items() if o is not None} == stored_next and sum(stored_next.values()) == len(
        sent
    )

    leftovers = [n for n in Replica(vllm_tiny).models() if published.match(n) or n.startswith("champion-")]
    assert leftovers == []
    assert httpx.get(f"{vllm_tiny}/health", timeout=5).status_code == 200
