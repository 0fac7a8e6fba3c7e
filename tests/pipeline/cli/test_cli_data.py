"""The data CLI commands on a throwaway typer app (``pipeline.cli.data.register``), against the real broker."""

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
from pipeline.cli.data import register
from pipeline.config import load_config

from tests.connectors.connector_helpers import wait_for

pytestmark = pytest.mark.integration


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_produce_replay_stats_and_dlq_commands(
    kafka_cfg: KafkaConfig,
    buffer_cfg: BufferConfig,
    tmp_path: Path,
    run_worker: Callable[..., IngestWorker],
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

    out = runner.invoke(
        _app(), ["produce", "--config", str(config), "--topic", kafka_cfg.traces_topic, str(data), "--json"]
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == {"topic": kafka_cfg.traces_topic, "acknowledged": 4}
    out = runner.invoke(_app(), ["replay", "--config", str(config), "--sharegpt", "20", "--json"])
    assert out.exit_code == 0, out.output
    replayed = json.loads(out.stdout)
    assert replayed["acknowledged"] == 20 == replayed["replayed"]
    skipped = replayed["dead_lettered_total"]  # unusable conversations of the dump: dead letters, not silence

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
    assert listing["count"] == 1 + skipped
    ingested = [d for d in listing["dead_letters"] if d["topic"] == kafka_cfg.traces_topic]
    assert len(ingested) == 1
    assert ingested[0]["reason"] == "invalid_json"
    assert ingested[0]["payload"].endswith("oops")


def test_bad_config_is_reported_with_exit_code_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[kafka]\nbootstrap_servers = ["nohost"]\npartitions = 0\n')
    out = CliRunner().invoke(_app(), ["dlq", "list", "--config", str(config), "--json"])
    assert out.exit_code == 2
    assert "bootstrap_servers" in out.output and "partitions" in out.output


def test_replay_a_sharegpt_file_of_my_choice_accounts_for_every_record(kafka_cfg: KafkaConfig, tmp_path: Path) -> None:
    config = tmp_path / "hourglass.toml"
    config.write_text(
        f'[kafka]\nbootstrap_servers = ["{kafka_cfg.bootstrap_servers[0]}"]\n'
        f'traces_topic = "{kafka_cfg.traces_topic}"\nfeedback_topic = "{kafka_cfg.feedback_topic}"\n'
        f'[buffer]\ndead_letter_root = "{tmp_path / "dlq"}"\n'
    )
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    records = [
        good,
        good,
        {"id": "x", "conversations": ["human: hi"]},
        {"id": "y", "conversations": []},
        {"id": "z", "conversations": [{"from": "bing", "value": "1\u20282"}]},
        7,
    ]
    data = tmp_path / "mine.json"
    data.write_text(json.dumps(records, ensure_ascii=False))
    runner = CliRunner()
    out = runner.invoke(_app(), ["replay", "--config", str(config), "--sharegpt-file", str(data), "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    assert result["replayed"] == 2 == result["acknowledged"]  # two records without id: two distinct traces
    assert result["dead_lettered"] == {
        "sharegpt_bad_turn": 1,
        "sharegpt_no_conversation": 1,
        "sharegpt_not_an_object": 1,
        "sharegpt_unknown_role": 1,
    }
    out = runner.invoke(_app(), ["dlq", "list", "--config", str(config), "--json"])  # U+2028 in a payload
    assert out.exit_code == 0, out.output
    listing = json.loads(out.stdout)
    assert listing["count"] == 4 and listing["skipped_lines"] == 0
    assert [d["offset"] for d in listing["dead_letters"]] == [3, 4, 5, 6]  # record numbers in the file
    assert json.loads(listing["dead_letters"][2]["payload"])["conversations"][0]["value"] == "1\u20282"
    out = runner.invoke(_app(), ["replay", "--config", str(config), "--sharegpt-file", str(tmp_path / "nope.json")])
    assert out.exit_code != 0 and "no such file" in out.output


@pytest.mark.parametrize("topic", ["bad topic!", "", "..", "x" * 250, "tópico"])
def test_produce_refuses_an_illegal_topic_name_with_a_message(topic: str, tmp_path: Path) -> None:
    """Not a kafka-python traceback: the rule, before any connection is tried (no broker at this address)."""
    data = tmp_path / "one.jsonl"
    data.write_text('{"schema": "hourglass.trace/v1"}\n')
    config = tmp_path / "hourglass.toml"
    config.write_text('[kafka]\nbootstrap_servers = ["127.0.0.1:9"]\n')
    out = CliRunner().invoke(_app(), ["produce", "--config", str(config), "--topic", topic, str(data)])
    assert out.exit_code == 1, out.output
    assert "Traceback" not in out.output and "not a legal Kafka topic name" in out.output


def test_produce_refuses_the_routes_topic(tmp_path: Path) -> None:
    """A backfill line keyed by its trace_id "hourglass" was a valid route record: any served name went live."""
    data = tmp_path / "route.jsonl"
    data.write_text('{"trace_id": "hourglass", "served_name": "hourglass-v1", "version": "1", "updated_at": ""}\n')
    config = tmp_path / "hourglass.toml"
    config.write_text('[kafka]\nbootstrap_servers = ["127.0.0.1:9"]\n')
    out = CliRunner().invoke(_app(), ["produce", "--config", str(config), "--topic", "hourglass.routes", str(data)])
    assert out.exit_code == 1, out.output
    assert "Traceback" not in out.output and "routes topic" in out.output and "hourglass promote" in out.output


def test_a_line_nested_past_the_parser_is_sent_keyless_not_a_crash() -> None:
    from connectors.sink import _key_of

    assert _key_of(b"[" * 5000) is None  # was RecursionError: `hourglass produce` stopped mid-file
    assert _key_of(b'{"trace_id": "t1"}') == b"t1"


def test_dlq_list_prints_hostile_details_as_text(tmp_path: Path) -> None:
    """Details quote traffic (a ShareGPT role, a field value): Rich markup in them must neither crash the
    table (an unmatched closing tag raised MarkupError) nor style the operator's terminal."""
    from connectors.dead_letter import DeadLetter, DeadLetterStore

    hostile = "role '[/bold] [link=https://evil.example]click[/link] [red]' is not one of ['gpt', 'human']"
    DeadLetterStore(str(tmp_path / "dlq")).write(
        [DeadLetter("sharegpt_unknown_role", hostile, "replay:sharegpt", 0, 1, b"{}")]
    )
    config = tmp_path / "hourglass.toml"
    config.write_text(f'[buffer]\nroot = "{tmp_path / "buf"}"\ndead_letter_root = "{tmp_path / "dlq"}"\n')
    out = CliRunner().invoke(_app(), ["dlq", "list", "--config", str(config)])
    assert out.exit_code == 0, out.output
    cells = [line.split("│")[-2] for line in out.output.splitlines() if line.count("│") == 6]  # the detail column
    shown = "".join(cells).replace(" ", "")
    assert "'[/bold][link=https://ev" in shown and "[red]'isnotoneof" in shown  # the markup shown literally
