"""Cross-site requests against the console, in headless Chromium: a page on another site submits forms to the
ops API while the browser holds the status page's Basic credentials, and changes nothing; the console's own
buttons still work.

The API runs with a non-loopback ``api.host`` (so the status page asks for the token through Basic auth, which
the browser then caches and re-sends on its own to that origin) but listens on 127.0.0.1. The attacker's page
is served by a second HTTP server, on ``localhost`` (another site: ``Sec-Fetch-Site: cross-site``). A round is
held running (its snapshot waits), and the model has a champion and a challenger in the real MLflow.
"""

from __future__ import annotations

import html
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pyarrow as pa
import pytest
import uvicorn
from mlflow.tracking import MlflowClient

from connectors.edge import EdgeLimits, server_config
from pipeline.api import create_api
from pipeline.canary import state
from pipeline.config import load_config
from pipeline.registry import aliases
from pipeline.registry.models import register_round
from pipeline.service import HourglassService
from pipeline.stack import free_port
from tests.pipeline.console.console_browser import start_chromium
from tests.pipeline.serving_helpers import make_adapter, make_round
from trainer.model.store import fingerprint_of

pytestmark = pytest.mark.integration

FORM = """<!doctype html><html><body><h1>win a prize</h1>
<form id="f" method="post" action="{action}" enctype="{enctype}"><input name="x" value="1"></form>
<script>document.getElementById("f").submit();</script></body></html>"""


class HeldSteps:
    """Round steps whose snapshot waits until released, then hands two rows on; reaching train fails the round
    (so a round that was not cancelled ends ``failed`` at train, a cancelled one ``cancelled``)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def buffer_rows(self) -> int:
        return 0

    def snapshot(self, window: str, until: Any = None) -> tuple[pa.Table, dict[str, Any]]:
        self.release.wait(600)
        return pa.table({"trace_id": ["a", "b"]}), {}

    def train_and_evaluate(self, *args: Any) -> Any:
        raise RuntimeError("stand-in: the round reached train")

    def __getattr__(self, name: str) -> Any:  # unload, retry_pending_rewards, ...: nothing to do
        return lambda *args, **kwargs: None


class Attacker(BaseHTTPRequestHandler):
    """``GET /?action=URL&enctype=TYPE``: a page that auto-submits a form to URL."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        query = parse_qs(urlsplit(self.path).query)
        page = FORM.format(action=html.escape(query["action"][0]), enctype=html.escape(query["enctype"][0]))
        body = page.encode()
        self.send_response(200)
        self.send_header("content-type", "text/html; charset=utf-8")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model: Path, mlflow_uri: str) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("xsite")
    model = f"xsite-{uuid.uuid4().hex[:8]}"
    api_port = free_port()
    conf = tmp / "hourglass.toml"
    conf.write_text(
        f'state_dir = "{tmp / "state"}"\n'
        f'[registry]\ntracking_uri = "{mlflow_uri}"\nexperiment = "{model}"\nembedded = false\n'
        f'[buffer]\nroot = "{tmp / "buffer"}"\ndead_letter_root = "{tmp / "dlq"}"\n'
        f'[serving]\nmodel_name = "{model}"\nembedded = false\n'
        f'[api]\nhost = "0.0.0.0"\nport = {api_port}\n'  # not loopback: the page asks for Basic credentials
    )
    cfg = load_config(conf)
    fp = fingerprint_of(tiny_model)
    adapter = make_adapter(tiny_model, tmp / "adapter", rank=4, seed=5)
    v1, v2, v3 = (
        register_round(cfg, make_round(adapter, fp, round_id=f"{model}-{i}", model=model))[0].version for i in range(3)
    )
    aliases.promote(cfg, model, v1)
    state.start_challenger(cfg, model, v2)
    service = HourglassService(cfg, base_fingerprint=fp, ingest=False, reconcile=False)
    steps = HeldSteps()
    service.runner.steps = steps  # type: ignore[assignment]
    server = uvicorn.Server(
        server_config(create_api(service), "127.0.0.1", api_port, EdgeLimits(), log_level="warning")
    )
    api_thread = threading.Thread(target=server.run, daemon=True)
    api_thread.start()
    evil = ThreadingHTTPServer(("127.0.0.1", 0), Attacker)
    evil_thread = threading.Thread(target=evil.serve_forever, daemon=True)
    evil_thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    try:
        yield {
            "cfg": cfg,
            "service": service,
            "steps": steps,
            "model": model,
            "versions": (v1, v2, v3),
            "api": f"http://127.0.0.1:{api_port}",
            "evil": f"http://localhost:{evil.server_address[1]}",
            "mlflow": MlflowClient(mlflow_uri),
        }
    finally:
        steps.release.set()
        service.runner.wait(60)
        evil.shutdown()
        server.should_exit = True
        api_thread.join(30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    driver = start_chromium(tmp_path_factory.mktemp("chromium") / "profile")
    try:
        yield driver
    finally:
        driver.quit()


def _wait(predicate, what: str, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def _open_console(browser, setup: dict[str, Any]) -> Any:
    from selenium.webdriver.common.by import By

    api, token = setup["api"], setup["service"].api_token
    browser.get(api.replace("http://", f"http://ops:{token}@") + "/")  # the Basic prompt, answered and cached
    browser.get(f"{api}/")  # the page as an operator has it: the browser re-sends the cached credentials itself
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#action-form button"), "the status page")
    return By


def test_a_form_on_another_site_changes_nothing_with_cached_basic_credentials(setup, browser) -> None:
    from selenium.webdriver.common.by import By

    service, model, (v1, v2, _) = setup["service"], setup["model"], setup["versions"]
    record = service.runner.start("api")  # held in its snapshot: running, cancellable
    _open_console(browser, setup)
    browser.get(f"{setup['api']}/rounds")  # the cached credentials read another page of the origin too
    assert record.round_id in browser.find_element(By.TAG_NAME, "body").text

    api = setup["api"]
    attacks = [
        (f"{api}/rounds/{record.round_id}/cancel", "application/x-www-form-urlencoded"),
        (f"{api}/canary/{model}/abort?reason=csrf", "text/plain"),
        (f"{api}/canary/{model}/promote", "multipart/form-data"),
        (f"{api}/canary/{model}/promote", "application/x-www-form-urlencoded"),
    ]
    from urllib.parse import urlencode

    for action, enctype in attacks:
        browser.get(f"{setup['evil']}/?{urlencode({'action': action, 'enctype': enctype})}")
        _wait(lambda: browser.current_url.startswith(api), f"the form to {action}")  # noqa: B023
        answer = _wait(lambda: browser.find_element(By.TAG_NAME, "body").text, "the API's answer")
        assert "cross-site request refused" in answer, (action, answer)

    client: MlflowClient = setup["mlflow"]
    assert aliases.champion_version(client, model, "champion") == v1
    assert state.challenger_version(client, setup["cfg"], model) == v2  # neither aborted nor promoted
    assert service.runner.current == record.round_id
    setup["steps"].release.set()
    assert service.runner.wait(60)
    final = service.store.get(record.round_id)
    assert final.state == "failed" and "reached train" in final.reason, final  # not cancelled


def test_the_consoles_own_buttons_still_work(setup, browser) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    model, (_, v2, v3), token = setup["model"], setup["versions"], setup["service"].api_token
    client: MlflowClient = setup["mlflow"]
    if state.challenger_version(client, setup["cfg"], model) != v2:
        state.start_challenger(setup["cfg"], model, v2)
    By = _open_console(browser, setup)

    def act(action: str, version: str = "") -> str:
        from selenium.webdriver.support.ui import Select

        Select(browser.find_element(By.ID, "action-model")).select_by_value(model)
        if version:
            field = browser.find_element(By.ID, "action-version")
            field.clear()
            field.send_keys(version)
        browser.find_element(By.CSS_SELECTOR, f'button[data-action="{action}"]').click()
        WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "token-dialog").is_displayed())
        field = browser.find_element(By.ID, "token-input")
        field.clear()  # the page offers the token typed last
        field.send_keys(token)
        browser.find_element(By.ID, "token-ok").click()

        # The line still shows the previous action's answer until this click's request starts:
        # wait for this action's own answer, not for any line without "sending".
        def answered(d) -> str | None:
            text = d.find_element(By.ID, "action-result").text
            return text if text.startswith(f"{action} ") and "sending" not in text else None

        return WebDriverWait(browser, 120).until(answered)

    aborted = act("canary-abort")
    assert aborted.startswith("canary-abort accepted (200)"), aborted
    assert state.challenger_version(client, setup["cfg"], model) is None
    promoted = act("promote", v3)
    assert promoted.startswith("promote accepted (200)"), promoted
    assert aliases.champion_version(client, model, "champion") == v3
    assert token not in browser.page_source
