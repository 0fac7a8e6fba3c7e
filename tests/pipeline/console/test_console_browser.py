"""The status page in headless Chromium, on a running service with the real broker,
MLflow and vLLM (tiny model), after a real round.

One service and one browser for the module. Traffic includes hostile strings
(a ``<script>`` completion, an ``onerror`` image as adapter version, a dead
letter carrying both, a round reason with a script) and a raw user id: the page
shows them as text, runs none of them, and never shows the id or the token.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from connectors.kafka_admin import ensure_topics
from connectors.schema import FeedbackEvent, TraceEvent
from connectors.sink import TraceSink
from pipeline.api import create_api
from pipeline.config import load_config
from pipeline.service import HourglassService, api_server_config
from pipeline.stack import free_port
from pipeline.demo.traffic import arithmetic_questions

from tests import REPO
from tests.pipeline.console.console_browser import console_errors, start_chromium
from tests.pipeline.serving_helpers import make_adapter, make_round

pytestmark = pytest.mark.integration

SCRIPT = "<script>window.__pwned = 1; document.title = 'pwned';</script>"
IMG = "<img src=x onerror=\"window.__pwned = 2; document.title = 'pwned'\">"
RAW_USER = "alice.raw-user@example.com"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "hourglass.json"


def _config(tmp: Path, broker: str, mlflow_uri: str, vllm_url: str, model: Path) -> Path:
    suffix = uuid.uuid4().hex[:8]
    conf = tmp / "hourglass.toml"
    conf.write_text(f"""
state_dir = "{tmp / "state"}"
[kafka]
bootstrap_servers = ["{broker}"]
embedded = false
traces_topic = "console.traces.{suffix}"
feedback_topic = "console.feedback.{suffix}"
group_id = "console-{suffix}"
partitions = 2
batch_timeout_ms = 200
[buffer]
root = "{tmp / "buffer"}"
dead_letter_root = "{tmp / "dlq"}"
[model]
name = "{model}"
[[candidates]]
name = "brief"
learning_rate = 1e-3
lora_rank = 4
lora_alpha = 8
reward = [{{ fn = "format", weight = 1.0 }}]
[rl]
steps_per_round = 1
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
experiment = "console-{suffix}"
[serving]
model_name = "console-{suffix}"
replicas = ["{vllm_url}"]
embedded = false
reconcile_interval_s = 1
staging_dir = "{tmp / "staging"}"
[api]
port = {free_port()}
""")
    return conf


def _produce(cfg) -> int:
    """Traces with thumbs (base and v1 answers), feedback events, one hostile trace, and one hostile record that
    is dead-lettered; returns how many valid records were sent."""
    sent = 0
    with TraceSink(cfg.kafka) as sink:
        for i, (question, reference) in enumerate(arithmetic_questions(16, seed=3)):
            sink.send_trace(
                TraceEvent(
                    trace_id=f"c-{i}",
                    ts=datetime.now(timezone.utc),
                    model=cfg.serving.model_name,
                    adapter_version="1" if i % 2 else None,
                    prompt=[{"role": "user", "content": question}],
                    completion=reference if i % 3 else SCRIPT,
                    thumbs="up" if i % 4 else "down",
                    metadata={"reference_answer": reference, "user_id": RAW_USER},
                )
            )
            sent += 1
        sink.send_trace(
            TraceEvent(
                trace_id="c-hostile",
                ts=datetime.now(timezone.utc),
                model=cfg.serving.model_name,
                adapter_version=IMG,
                prompt=[{"role": "user", "content": SCRIPT}],
                completion=SCRIPT + IMG,
                thumbs="up",
            )
        )
        sent += 1
        for i in range(0, 16, 4):  # thumbs down given later, as separate feedback events
            sink.send_feedback(FeedbackEvent(trace_id=f"c-{i}", thumbs="down", metadata={"user_id": RAW_USER}))
            sent += 1
        bad = {
            "schema": "hourglass.trace/v1",
            "trace_id": "c-bad",
            "completion": SCRIPT + IMG,
            "metadata": {"user_id": RAW_USER},
        }
        sink.send_raw(cfg.kafka.traces_topic, json.dumps(bad).encode(), b"c-bad")  # no ts/model/prompt: dead-lettered
        assert sink.flush() == sent + 1
    return sent


def _wait(predicate, what: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def console(tmp_path_factory, broker: str, mlflow_uri: str, vllm_tiny: str, tiny_model: Path):
    """(api base URL, service) after one real round and a promoted champion, served by vLLM."""
    tmp = tmp_path_factory.mktemp("console")
    cfg = load_config(_config(tmp, broker, mlflow_uri, vllm_tiny, tiny_model))
    ensure_topics(cfg.kafka)
    sent = _produce(cfg)
    service = HourglassService(cfg)
    service.start()
    server = uvicorn.Server(api_server_config(create_api(service), cfg))  # as `hourglass service` serves it
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    api = f"http://127.0.0.1:{cfg.api.port}"
    try:
        _wait(lambda: server.started, "the API")
        _wait(
            lambda: (
                sum(service.buffer_stats()[k] for k in ("trace_rows", "feedback_rows")) >= sent
                and service.ingest_worker.stats().dead_letters >= 1
            ),
            "ingestion",
        )
        record = service.runner.run("manual")  # a real round: snapshot, HF rollouts, gate
        assert record.state in ("done", "no_winner"), record.reason
        if (
            not record.versions
        ):  # the tiny random model rarely beats the base: promote a real adapter the way a round does
            from pipeline.registry.models import register_round

            adapter = make_adapter(tiny_model, tmp / "adapter", rank=4, seed=7)
            register_round(
                cfg,
                make_round(adapter, service.base_fingerprint, round_id="r-seeded", model=cfg.serving.model_name),
                promote=True,
            )
        service.controller.trigger()
        _wait(lambda: service.controller.status()[cfg.serving.model_name]["serving"], "the champion to be served", 180)
        assert service.runner.run("manual").state in ("done", "no_winner")  # a second round, against that champion
        settled = lambda: (st := service.controller.status()[cfg.serving.model_name])["serving"] == st["desired"]  # noqa: E731
        _wait(settled, "the champion to be served", 180)
        hostile = service.store.create("api", ["brief"], "1h")
        service.store.transition(hostile, "failed", f"train: ValueError: {SCRIPT}{IMG}")
        yield api, service
    finally:
        server.should_exit = True
        thread.join(30)
        service.shutdown()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    profile = tmp_path_factory.mktemp("chromium") / "profile"
    driver = start_chromium(profile)
    try:
        yield driver
    finally:
        driver.quit()


def _open(browser, api: str):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{api}/")
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#rounds tbody tr"))
    return By


def _fmt(value) -> str:
    return "–" if value is None else f"{float(value):.3f}"


def test_page_matches_the_api_and_draws_charts(console, browser, tmp_path: Path) -> None:
    api, service = console
    status = httpx.get(f"{api}/status", timeout=30).json()
    rounds = httpx.get(f"{api}/rounds", timeout=30).json()
    By = _open(browser, api)

    model = service.cfg.serving.model_name
    serving = status["serving"][model]
    row = browser.find_element(By.CSS_SELECTOR, f'#models tr[data-model="{model}"]')
    assert row.find_element(By.CSS_SELECTOR, '[data-field="champion"]').text.startswith(f"v{serving['desired']}")
    assert row.find_element(By.CSS_SELECTOR, '[data-field="serving"]').text == f"v{serving['serving']}"
    assert row.find_element(By.CSS_SELECTOR, '[data-field="promoted"]').text.startswith("round r")
    assert browser.find_element(By.ID, "canary").text == "no canary"
    assert browser.find_element(By.ID, "base-fingerprint").get_attribute("title") == service.base_fingerprint

    for record in rounds:
        tr = browser.find_element(By.CSS_SELECTOR, f'#rounds tr[data-round="{record["round_id"]}"]')
        assert tr.find_element(By.CSS_SELECTOR, '[data-field="state"]').text == record["state"]
        assert tr.find_element(By.CSS_SELECTOR, '[data-field="trigger"]').text == record["trigger"]
        assert tr.find_element(By.CSS_SELECTOR, '[data-field="reason"]').text.startswith(record["reason"])
        for served, decision in record["decisions"].items():
            block = tr.find_element(By.CSS_SELECTOR, f'[data-decision="{served}"]')
            assert block.find_element(By.CSS_SELECTOR, '[data-field="champion-reward"]').text == _fmt(
                decision["champion_reward"]
            )
            for name, reward in decision["candidate_rewards"].items():
                assert block.find_element(By.CSS_SELECTOR, f'[data-candidate="{name}"]').text == _fmt(reward)
            assert (
                block.find_element(By.CSS_SELECTOR, '[data-field="gate-reason"]').text == f"gate: {decision['reason']}"
            )
    assert any(r["decisions"] for r in rounds)  # the real round evaluated its candidate against the champion

    ingest = status["ingest"]
    assert browser.find_element(By.ID, "ingest-traces").text == str(int(ingest["ingest/traces"]))
    assert browser.find_element(By.ID, "ingest-dead").text == str(int(ingest["ingest/dead_letters"]))
    assert browser.find_element(By.ID, "buffer-traces").text == str(status["buffer"]["trace_rows"])
    reasons = browser.find_element(By.ID, "dead-reasons").text.splitlines()
    assert sum(int(line.rsplit(" ", 1)[1]) for line in reasons) == int(ingest["ingest/dead_letters"])
    assert "c-bad" in browser.find_element(By.ID, "dead-newest").text
    lag = browser.find_element(By.ID, "lag").text
    assert service.cfg.kafka.traces_topic + ":0" in lag

    for kind in ("heldout", "feedback", "hourly"):  # drawn, with data points
        svg = browser.find_element(By.CSS_SELECTOR, f'svg[data-chart="{kind}"]')
        assert svg.size["width"] > 100 and svg.size["height"] > 50
        marks = svg.find_elements(By.CSS_SELECTOR, "circle, rect[height]")
        assert any(float(m.get_attribute("height") or 1) > 0 for m in marks), kind
    feedback = browser.find_element(By.CSS_SELECTOR, 'svg[data-chart="feedback"]').get_attribute("innerHTML")
    assert "base" in feedback and "v1" in feedback

    time.sleep(float(browser.find_element(By.TAG_NAME, "body").get_attribute("data-refresh-s")) + 2)  # one self-refresh
    assert "refreshed" in browser.find_element(By.ID, "refreshed").text
    assert console_errors(browser) == []  # neither at load nor at the refresh
    shot = tmp_path / "console.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("HOURGLASS_CONSOLE_SCREENSHOT"):  # how docs/console.png is made
        shutil.copy(shot, os.environ["HOURGLASS_CONSOLE_SCREENSHOT"])


def test_hostile_strings_are_shown_as_text_and_never_run(console, browser) -> None:
    api, service = console
    By = _open(browser, api)
    assert browser.execute_script("return window.__pwned === undefined && document.title") == "Hourglass console"
    page = browser.find_element(By.TAG_NAME, "body").text
    assert "<script>window.__pwned" in page  # the round reason and the dead letter, as text
    assert "onerror" in page
    assert not browser.find_elements(By.CSS_SELECTOR, "#panels script, #panels img")
    source = browser.page_source
    assert RAW_USER not in source and service.api_token not in source
    assert service.cfg.buffer.user_hash_key.get_secret_value() not in source
    assert console_errors(browser) == []  # not even a CSP violation: nothing tried to run


def test_rollback_without_a_token_is_refused_on_the_page(console, browser) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    api, service = console
    By = _open(browser, api)
    model = service.cfg.serving.model_name
    before = httpx.get(f"{api}/status", timeout=30).json()["serving"][model]["desired"]
    browser.find_element(By.CSS_SELECTOR, 'button[data-action="rollback"]').click()
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "token-dialog").is_displayed())
    browser.find_element(By.ID, "token-ok").click()  # no token typed
    result = WebDriverWait(browser, 20).until(
        lambda d: (
            d.find_element(By.ID, "action-result").text
            if "refused" in d.find_element(By.ID, "action-result").text
            else None
        )
    )
    refusal = httpx.post(f"{api}/rollback", json={"model": model}, timeout=30).json()["detail"]
    assert result == f"rollback refused (401): {refusal}"  # the API's own words
    assert httpx.get(f"{api}/status", timeout=30).json()["serving"][model]["desired"] == before
    assert [e for e in console_errors(browser) if "401" not in e["message"]] == []  # only the refused call

    browser.find_element(By.ID, "action-version").send_keys(before)  # with the token: promote the champion again
    browser.find_element(By.CSS_SELECTOR, 'button[data-action="promote"]').click()
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "token-dialog").is_displayed())
    browser.find_element(By.ID, "token-input").send_keys(service.api_token)
    browser.find_element(By.ID, "token-ok").click()
    result = WebDriverWait(browser, 30).until(
        lambda d: (
            d.find_element(By.ID, "action-result").text
            if "accepted" in d.find_element(By.ID, "action-result").text
            else None
        )
    )
    assert result.startswith("promote accepted (200)") and f'"version":"{before}"' in result
    assert service.api_token not in browser.page_source  # the token is not written into the page


def test_every_dashboard_metric_is_exported(console) -> None:
    api, _ = console
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {name for expr in exprs for name in re.findall(r"\bhourglass_[a-z0-9_]+\b", expr)}
    assert len(queried) >= 8, queried
    exported = set()
    for family in text_string_to_metric_families(httpx.get(f"{api}/metrics", timeout=60).text):
        exported.add(family.name)
        exported.update(sample.name for sample in family.samples)
        if family.type == "histogram":
            exported.update(f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        if family.type == "counter":
            exported.add(f"{family.name}_total")
    assert queried <= exported, sorted(queried - exported)
    model = console[1].cfg.serving.model_name
    rates = {
        s.labels["version"]: s.value
        for f in text_string_to_metric_families(httpx.get(f"{api}/metrics", timeout=60).text)
        if f.name == "hourglass_live_feedback_rate"
        for s in f.samples
        if s.labels["served_model"] == model
    }
    assert rates == {
        "base": 0.5,
        "1": 1.0,
    }  # thumbs of _produce: base answers half up, v1 answers all up; hostile version left out
