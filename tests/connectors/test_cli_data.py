"""The data CLI commands on a throwaway typer app (``pipeline.cli_data.register``), against the real broker."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from connectors.config import BufferConfig, KafkaConfig
from connectors.ingest import IngestWorker
from pipeline.cli_data import register
from pipeline.config import load_config

from connector_helpers import wait_for

pytestmark = pytest.mark.integration


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_produce_replay_stats_and_dlq_commands(
    kafka_cfg: KafkaConfig, buffer_cfg: BufferConfig, tmp_path: Path, run_worker: Callable[..., IngestWorker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths in the config are relative to the cwd
    config = tmp_path / "hourglass.toml"
    config.write_text(
        f'[kafka]\nbootstrap_servers = ["{kafka_cfg.bootstrap_servers[0]}"]\n'
        f'traces_topic = "{kafka_cfg.traces_topic}"\nfeedback_topic = "{kafka_cfg.feedback_topic}"\n'
        f'group_id = "{kafka_cfg.group_id}"\n[buffer]\nroot = "buf"\ndead_letter_root = "dlq"\n'
    )
    two_hours_ago = (datetime.now(timezone.utc) - timedelta(hours=2)).isoformat()  # inside the accepted ts window
    trace = {"schema": "hourglass.trace/v1", "ts": two_hours_ago, "model": "m", "prompt": "p", "completion": "c"}
    lines = [json.dumps({**trace, "trace_id": f"t{i}", **({"thumbs": "up"} if i == 0 else {})}) for i in range(3)]
    data = tmp_path / "traces.jsonl"
    data.write_text("\n".join([*lines, '{"schema": "hourglass.trace/v1", oops']) + "\n")
    runner = CliRunner()

    out = runner.invoke(_app(), ["produce", "--config", str(config), "--topic", kafka_cfg.traces_topic, str(data), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == {"topic": kafka_cfg.traces_topic, "acknowledged": 4}
    out = runner.invoke(_app(), ["replay", "--config", str(config), "--sharegpt", "20", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["acknowledged"] == 20

    cfg = load_config(config)
    worker = run_worker(cfg.kafka, cfg.buffer)
    wait_for(lambda: worker.stats().traces >= 23 and worker.stats().dead_letters >= 1, 60, "23 traces + 1 dead letter")
    assert (tmp_path / "buf" / "traces").is_dir()

    out = runner.invoke(_app(), ["buffer", "stats", "--config", str(config), "--json"])
    assert out.exit_code == 0, out.output
    stats = json.loads(out.stdout)
    assert stats["unique_traces"] == 23 and stats["rewarded_traces"] == 1
    assert stats["reward_coverage"] == pytest.approx(1 / 23)
    assert stats["partitions"] >= 2 and stats["bytes"] > 0
    topics = (kafka_cfg.traces_topic, kafka_cfg.feedback_topic)
    assert set(stats["lag_records"]) == {f"{t}:{p}" for t in topics for p in range(3)}  # default: 3 partitions
    assert all(isinstance(v, int) and v >= 0 for v in stats["lag_records"].values())

    out = runner.invoke(_app(), ["dlq", "list", "--config", str(config), "--json"])
    assert out.exit_code == 0, out.output
    listing = json.loads(out.stdout)
    assert listing["count"] == 1
    assert listing["dead_letters"][0]["reason"] == "invalid_json"
    assert listing["dead_letters"][0]["payload"].endswith("oops")


def test_bad_config_is_reported_with_exit_code_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[kafka]\nbootstrap_servers = ["nohost"]\npartitions = 0\n')
    out = CliRunner().invoke(_app(), ["dlq", "list", "--config", str(config), "--json"])
    assert out.exit_code == 2
    assert "bootstrap_servers" in out.output and "partitions" in out.output
