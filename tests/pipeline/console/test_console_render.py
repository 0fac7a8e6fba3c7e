"""The status page without a browser: escaping of hostile traffic, redaction, the
viewing rule, the charts, and the Grafana/Prometheus files."""

from __future__ import annotations

import base64
import threading
import time
import json
import re
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from connectors.buffer import RewardBuffer
from connectors.dead_letter import DeadLetter, DeadLetterStore
from connectors.schema import TraceEvent
from connectors.segments import Coordinates
from pipeline.api import create_api
from pipeline.config import HourglassConfig, load_config
from pipeline.console import is_loopback
from pipeline.console.charts import bar_chart, line_chart
from pipeline.console.data import mlflow_ui_base, redact
from pipeline.service import HourglassService
from tests import REPO

SCRIPT = "<script>window.__pwned=1</script>"
IMG = '<img src=x onerror="window.__pwned=2">'
DEPLOY = REPO / "deploy"


def _service(tmp_path: Path, host: str = "127.0.0.1") -> HourglassService:
    cfg = HourglassConfig(
        state_dir=str(tmp_path / "state"),
        buffer={"root": str(tmp_path / "buffer"), "dead_letter_root": str(tmp_path / "dlq")},
        registry={"tracking_uri": "http://ops:s3cret-pass@127.0.0.1:1/mlflow", "embedded": False},
        api={"host": host},
    )
    return HourglassService(cfg, base_fingerprint="ab" * 32, ingest=False, reconcile=False)


def _hostile_traffic(service: HourglassService) -> None:
    now = datetime.now(timezone.utc)
    traces = [
        (
            TraceEvent(
                trace_id=f"t{i}",
                ts=now,
                model="hourglass",
                adapter_version=IMG if i == 0 else "2",
                prompt=SCRIPT,
                completion=SCRIPT + IMG,
                thumbs="up" if i % 2 else "down",
            ),
            Coordinates("traces", 0, i),
        )
        for i in range(4)
    ]
    RewardBuffer(service.cfg.buffer).append(traces, [])
    DeadLetterStore(service.cfg.buffer.dead_letter_root).write(
        [
            DeadLetter(f"bad_{SCRIPT}", f"detail {IMG}", "traces", 1, 7, (SCRIPT + IMG + "x" * 500).encode()),
            DeadLetter("not_utf8", "bytes", "traces", 1, 8, b"\xff\xfe<script>"),
        ]
    )
    record = service.store.create("api", ["default"], "1h")
    record.decisions = {
        "hourglass": {
            "winner": None,
            "reason": f"gate {SCRIPT}",
            "champion_reward": 0.25,
            "candidate_rewards": {"default": 0.5, "diverged": float("nan")},
            "lower_bounds": {"default": -0.1},
        }
    }
    record.metrics = {"reward_model/auc": 0.75}
    service.store.save(record)
    service.store.transition(record, "no_winner", f"hourglass: {SCRIPT}{IMG}")


def test_hostile_strings_are_escaped_everywhere(tmp_path: Path) -> None:
    service = _service(tmp_path)
    _hostile_traffic(service)
    with TestClient(create_api(service), base_url="http://127.0.0.1") as client:
        for path in ("/", "/console/panels"):
            response = client.get(path)
            assert response.status_code == 200
            html = response.text
            assert "<script>window" not in html and "<img" not in html and 'onerror="' not in html
            assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in html  # shown, as text
            assert [m.group(0) for m in re.finditer(r"<script\b[^>]*>", html)] == (
                ['<script src="/console/static/console.js" defer>'] if path == "/" else []
            )
            assert "s3cret-pass" not in html and service.api_token not in html
            assert "xxxxx" * 41 not in html  # the payload was cut to 200 characters
            csp = response.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "unsafe-inline" not in csp
        data = client.get("/console/data").json()
        metrics = client.get("/metrics").text
    assert 'hourglass_live_feedback_rate{served_model="hourglass",version="2"} 0.6666' in metrics
    assert "onerror" not in metrics
    assert data["rounds"][0]["reward_model_auc"] == 0.75 and data["rounds"][0]["state"] == "no_winner"
    assert [(c["name"], c["reward"]) for c in data["rounds"][0]["decisions"][0]["candidates"]] == [
        ("default", 0.5),
        ("diverged", None),
    ]
    assert data["ingest"]["dead_letters"]["by_reason"] == {f"bad_{SCRIPT}": 1, "not_utf8": 1}
    assert data["feedback"]["series"].keys() == {IMG, "2"}  # the chart shows what traffic says, escaped
    assert [(r["model"], r["version"], r["traces"]) for r in data["feedback"]["live"]] == [
        ("hourglass", "2", 3)
    ]  # the gauge: known labels only
    assert any("MLflow registry" in e and "***@" in e for e in data["errors"]), data["errors"]  # unreachable, redacted


def test_charts_render_points_and_say_when_empty(tmp_path: Path) -> None:
    service = _service(tmp_path)
    _hostile_traffic(service)
    with TestClient(create_api(service), base_url="http://127.0.0.1") as client:
        html = client.get("/").text
    for kind in ("heldout", "feedback", "auc", "hourly"):
        svg = re.search(rf'<svg class="chart" data-chart="{kind}".*?</svg>', html, re.S)
        assert svg is not None, kind
        assert "<circle" in svg.group(0) or "<rect" in svg.group(0)
    assert "no data yet" in line_chart({"a": []}, title="t", kind="k")
    assert "<title>x 05: 3</title>" in bar_chart(["05"], {"x": [3]}, title="t", kind="k")


def test_viewing_needs_the_token_off_loopback(tmp_path: Path) -> None:
    service = _service(tmp_path, host="0.0.0.0")
    with TestClient(create_api(service), base_url="http://127.0.0.1") as client:
        refused = client.get("/")
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
        assert client.get("/console/data", headers={"Authorization": "Bearer wrong-token"}).status_code == 401
        basic = base64.b64encode(f"ops:{service.api_token}".encode()).decode()
        assert client.get("/", headers={"Authorization": f"Basic {basic}"}).status_code == 200
        assert (
            client.get("/console/panels", headers={"Authorization": f"Bearer {service.api_token}"}).status_code == 200
        )
        assert client.get("/console/static/console.js").status_code == 200  # no secrets in the static files
    with TestClient(create_api(_service(tmp_path / "lo")), base_url="http://127.0.0.1") as client:
        assert client.get("/").status_code == 200


def test_loopback_and_redaction_helpers() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("example.com")
    assert redact("http://u:p@h:5000/x?token=abc&a=1 Bearer xyz.123") == "http://***@h:5000/x?token=***&a=1 Bearer ***"
    assert mlflow_ui_base("https://u:p@mlflow.example:8443/base/?k=v#f") == "https://mlflow.example:8443/base"
    assert mlflow_ui_base("file:///tmp/mlruns") is None


def test_grafana_and_prometheus_files_agree_with_compose() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        image = services[name]["image"]
        assert re.search(r":\$\{[A-Z_]+:-v?\d+\.\d+\.\d+\}$", image), f"{name} image must be pinned: {image}"
        for spec in services[name]["volumes"]:
            source = spec.split(":")[0]
            assert not source.startswith(".") or (DEPLOY / source).exists(), spec
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    port = load_config(DEPLOY / "production.toml").api.port
    assert prometheus["scrape_configs"][0]["static_configs"][0]["targets"] == [f"service:{port}"]
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())[
        "datasources"
    ][0]
    assert datasource["url"] == "http://prometheus:9090"
    dashboard = json.loads((DEPLOY / "grafana/dashboards/hourglass.json").read_text())
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    assert targets and all(t["datasource"]["uid"] == datasource["uid"] for t in targets)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


@pytest.mark.parametrize("text", [SCRIPT, IMG])
def test_chart_labels_are_escaped(text: str) -> None:
    svg = line_chart({text: [(1, 0.5), (2, 0.7)]}, title=text, kind="k") + bar_chart(
        [text], {text: [1]}, title=text, kind="k"
    )
    assert "<script" not in svg and "<img" not in svg


def test_a_slow_source_does_not_hold_the_page(tmp_path: Path) -> None:
    service = _service(tmp_path)
    release = threading.Event()
    service.status = lambda: release.wait(30) and {}  # e.g. a broker that does not answer
    try:
        with TestClient(create_api(service), base_url="http://127.0.0.1") as client:
            started = time.monotonic()
            html = client.get("/").text
            assert time.monotonic() - started < 8
            assert "status: no answer within 3 s; showing the last values (still asking)" in html
            assert 'id="rounds"' in html  # the rest of the page is there
    finally:
        release.set()


def test_canary_abort_button_only_with_a_canary_endpoint(tmp_path: Path) -> None:
    service = _service(tmp_path)
    app = create_api(service)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        html = client.get("/").text  # the ops API has POST /canary/{model}/abort (pipeline.canary.ops)
        assert 'data-action="canary-abort" data-path="/canary/{model}/abort"' in html
        app.router.routes[:] = [r for r in app.router.routes if not getattr(r, "path", "").startswith("/canary")]
        html = client.get("/").text
        assert 'data-action="canary-abort"' not in html and 'id="canary" class="muted">no canary<' in html


def test_live_feedback_gauge_labels_stay_bounded_under_forged_versions(tmp_path: Path) -> None:
    """``adapter_version`` comes from traffic: 40 distinct numeric versions (plus Unicode digits, which
    ``str.isdigit`` accepts) must not become 40 Prometheus series; the gauge keeps the MAX_VERSIONS
    versions with the most traces per served model, ASCII digits only."""
    from pipeline.console.data import MAX_VERSIONS

    service = _service(tmp_path)
    now = datetime.now(timezone.utc)
    versions = ["2"] * 5 + [str(10_000 + i) for i in range(40)] + ["²", "٣"]
    traces = [
        (
            TraceEvent(
                trace_id=f"t{i}", ts=now, model="hourglass", adapter_version=v, prompt="p", completion="c", thumbs="up"
            ),
            Coordinates("traces", 0, i),
        )
        for i, v in enumerate(versions)
    ]
    RewardBuffer(service.cfg.buffer).append(traces, [])
    with TestClient(create_api(service), base_url="http://127.0.0.1") as client:
        metrics = client.get("/metrics").text
        live = client.get("/console/data").json()["feedback"]["live"]
    series = [line for line in metrics.splitlines() if line.startswith("hourglass_live_feedback_rate{")]
    assert len(series) == len(live) == MAX_VERSIONS, series
    assert (
        'hourglass_live_feedback_rate{served_model="hourglass",version="2"} 1.0' in metrics
    )  # the busiest version stays
    assert "²" not in metrics and "٣" not in metrics


def test_dead_letters_whose_payload_holds_line_separators_are_counted(tmp_path: Path) -> None:
    """Dead-letter files are JSON lines split on \\n only: a payload with U+2028 / U+0085 / \\x0c (kept raw by
    ensure_ascii=False) must still count, not vanish from the page's counts and newest list."""
    service = _service(tmp_path)
    DeadLetterStore(service.cfg.buffer.dead_letter_root).write(
        [
            DeadLetter("schema_violation", "d", "traces", 0, 1, "a\u2028b\x85c\x0cd".encode()),
            DeadLetter("invalid_json", "d", "traces", 0, 2, b"plain"),
        ]
    )
    damaged = Path(service.cfg.buffer.dead_letter_root) / "dt=2000-01-01" / "dlq-0000000000000-x-000000.jsonl"
    damaged.parent.mkdir(parents=True)
    damaged.write_text(
        '5\n["a"]\n{"reason": "not_utf8", "topic": "t", "partition": 0, "offset": 0}\n'
    )  # a damaged file
    with TestClient(create_api(service), base_url="http://127.0.0.1") as client:
        dead = client.get("/console/data").json()["ingest"]["dead_letters"]
    assert dead["by_reason"] == {"schema_violation": 1, "invalid_json": 1, "not_utf8": 1}
    assert [d["where"] for d in dead["newest"]] == ["traces:0@2", "traces:0@1", "t:0@0"]


def test_canary_panel_lists_running_canaries_and_last_decisions() -> None:
    from pipeline.console.data import canary_view

    running = {
        "version": "3",
        "champion_version": "2",
        "fraction": 0.2,
        "decision": "continue",
        "reason": "12 vs 10 events",
    }
    view = canary_view(
        {"hg": {"canary": running, "guard": None, "last_canary": None, "last_guard": {"decision": "passed"}}}
    )
    assert view == {
        "hg canary": "version 3; champion_version 2; fraction 0.2; decision continue; reason 12 vs 10 events",
        "hg last guard": "decision passed",
    }
    assert canary_view({"hg": {"canary": None, "guard": None, "last_canary": None, "last_guard": None}}) == {}
    assert canary_view(None) == {} and canary_view("garbage") == {}
