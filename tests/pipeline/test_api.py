"""The ops API: token on every mutation, clear refusals, read-only views."""

from __future__ import annotations

import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pipeline.api import create_api
from pipeline.config import load_config
from pipeline.service import HourglassService


@pytest.fixture
def service(tmp_path: Path) -> HourglassService:
    cfg = load_config(None).model_copy(update={"state_dir": str(tmp_path)})
    return HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)


@pytest.fixture
def client(service: HourglassService) -> Iterator[TestClient]:
    with TestClient(create_api(service), base_url="http://localhost") as test_client:  # Host must name the API
        yield test_client


def test_generated_token_is_private_and_stable(service: HourglassService, tmp_path: Path) -> None:
    token_file = tmp_path / "api-token"
    assert token_file.read_text() == service.api_token and len(service.api_token) >= 32
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    again = HourglassService(service.cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)
    assert again.api_token == service.api_token


def test_mutations_without_or_with_a_wrong_token_are_refused(client: TestClient, service: HourglassService) -> None:
    for method, path, body in [
        ("POST", "/rounds", {}),
        ("POST", "/rounds/r1/cancel", None),
        ("POST", "/promote", {"version": "1"}),
        ("POST", "/rollback", {}),
    ]:
        response = client.request(method, path, json=body)
        assert response.status_code == 401, path
        assert "Bearer" in response.json()["detail"]
        response = client.request(method, path, json=body, headers={"Authorization": "Bearer nope"})
        assert response.status_code == 403, path
    assert service.store.list() == []  # nothing was started


def test_reads_need_no_token(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/rounds").json() == []
    assert client.get("/rounds/r-nope").status_code == 404
    metrics = client.get("/metrics").text
    assert "hourglass_rounds_total" in metrics and "hourglass_buffer_rows" in metrics


def test_trigger_while_another_process_runs_a_round_is_refused(
    client: TestClient, service: HourglassService, tmp_path: Path
) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import time
            from pipeline.rounds.records import RoundLock
            RoundLock({str(tmp_path)!r}).acquire("r-running")
            print("held", flush=True); time.sleep(60)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        auth = {"Authorization": f"Bearer {service.api_token}"}
        response = client.post("/rounds", json={"window": "6h"}, headers=auth)
        assert response.status_code == 409
        assert "already running" in response.json()["detail"] and "r-running" in response.json()["detail"]
    finally:
        holder.kill()
        holder.wait()
    assert service.store.list() == []  # a refused trigger leaves no round record behind


def test_bad_retrain_requests_are_refused_with_reasons(client: TestClient, service: HourglassService) -> None:
    auth = {"Authorization": f"Bearer {service.api_token}"}
    response = client.post("/rounds", json={"candidates": ["nope"]}, headers=auth)
    assert response.status_code == 422 and "unknown candidate" in response.json()["detail"]
    assert client.post("/rounds", json={"window": "soon"}, headers=auth).status_code == 422
    assert client.post("/rounds", json={"surprise": 1}, headers=auth).status_code == 422
    empty = client.post("/rounds", json={"candidates": []}, headers=auth)  # was a round of every candidate
    assert empty.status_code == 422 and "candidates" in str(empty.json()["detail"])
    assert service.runner.current is None and client.get("/rounds").json() == []
    response = client.post("/rounds/r-x/cancel", headers=auth)
    assert response.status_code == 409 and "not running" in response.json()["detail"]


@pytest.mark.parametrize(
    ("until", "complaint"),
    [
        ("9999-12-31T23:59:59+14:00", "in the future"),
        ("2999-01-01T00:00:00Z", "in the future"),
        ("0001-01-01T10:00:00+14:00", "outside years 1 to 9999"),  # 0000-12-31 in UTC: was an OverflowError
        ("0001-01-01T00:00:00Z", "outside years 1 to 9999"),  # the window (6h) would start before year 1
    ],
)
def test_a_replay_of_a_window_that_has_not_ended_or_cannot_exist_is_refused(
    client: TestClient, service: HourglassService, until: str, complaint: str
) -> None:
    auth = {"Authorization": f"Bearer {service.api_token}"}
    response = client.post("/rounds", json={"window": "6h", "until": until}, headers=auth)
    assert response.status_code == 422, response.text
    assert "until" in response.json()["detail"] and complaint in response.json()["detail"]
    assert service.runner.current is None and service.store.list() == []


def test_a_replay_round_reads_the_window_that_ended_then(client: TestClient, service: HourglassService) -> None:
    auth = {"Authorization": f"Bearer {service.api_token}"}
    response = client.post("/rounds", json={"window": "2h", "until": "2026-01-05T08:30:00+01:00"}, headers=auth)
    assert response.status_code == 202, response.text
    assert response.json()["until"] == "2026-01-05T07:30:00+00:00"  # kept in UTC
    assert client.get("/").status_code == 200
    assert service.runner.wait(60)
    record = client.get(f"/rounds/{response.json()['round_id']}").json()
    assert record["state"] == "no_winner"
    assert "in the 2h until 2026-01-05T07:30:00+00:00" in record["reason"]  # the empty buffer of that window
    assert record["metrics"]["data/rows"] == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [("/promote", {"version": "99999999999999999999"}), ("/promote", {"version": "1"}), ("/rollback", {})],
)
def test_registry_errors_never_echo_the_tracking_uri_credentials(tmp_path: Path, path: str, body: dict) -> None:
    """MLflow's error messages quote the request URL, user:password included: the API's refusal must not."""
    cfg = load_config(None).model_copy(update={"state_dir": str(tmp_path)})
    cfg = cfg.model_copy(
        update={
            "registry": cfg.registry.model_copy(update={"tracking_uri": "http://ops:s3cret-pass@127.0.0.1:1/mlflow"})
        }
    )
    service = HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)
    with TestClient(create_api(service)) as client:
        response = client.post(path, json=body, headers={"Authorization": f"Bearer {service.api_token}"})
    assert 400 <= response.status_code < 600 and response.status_code != 500, response.text
    assert "s3cret-pass" not in response.text and "detail" in response.json()


# --- cross-site requests and one reading of every input (issue 24) ----------------------------------------

MUTATIONS = [
    ("/rounds", {"window": "6h"}),
    ("/rounds/r-x/cancel", None),
    ("/promote", {"version": "1"}),
    ("/rollback", {}),
    ("/canary/hourglass/abort", None),
    ("/canary/hourglass/promote", None),
]


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Origin": "http://localhost.evil.example"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},  # another port of the same host is another origin
    ],
)
def test_cross_site_state_changes_are_refused_even_with_the_token(
    client: TestClient, service: HourglassService, headers: dict[str, str]
) -> None:
    auth = {"Authorization": f"Bearer {service.api_token}", **headers}
    for path, body in MUTATIONS:
        response = client.post(path, json=body, headers=auth)
        assert response.status_code == 403, (path, response.text)
        assert "cross-site request refused" in response.json()["detail"]
    assert service.store.list() == [] and service.runner.current is None  # no round was started


def test_the_apis_own_origin_and_non_browser_clients_may_change_state(
    client: TestClient, service: HourglassService
) -> None:
    auth = {"Authorization": f"Bearer {service.api_token}"}
    for extra in ({}, {"Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"}):
        response = client.post("/rounds/r-x/cancel", headers={**auth, **extra})
        assert response.status_code == 409 and "not running" in response.json()["detail"]  # the handler ran


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/plain"]
)
def test_form_content_types_cannot_change_state(
    client: TestClient, service: HourglassService, content_type: str
) -> None:
    auth = {"Authorization": f"Bearer {service.api_token}", "Content-Type": content_type}
    for path, _ in MUTATIONS:
        response = client.post(path, content=b"x=1", headers=auth)
        assert response.status_code == 415, (path, response.text)
        assert "form" in response.json()["detail"]
    assert client.post("/rounds/r-x/cancel", content=b"", headers=auth).status_code == 415  # an empty form too
    assert service.store.list() == []


def test_basic_credentials_read_the_page_but_never_change_state(tmp_path: Path) -> None:
    """What a browser caches for the status page (Basic) is re-sent on any request to the origin, also on
    a form another site submits: it reads, it never changes state."""
    import base64

    cfg = load_config(None).model_copy(update={"state_dir": str(tmp_path)})
    cfg = cfg.model_copy(update={"api": cfg.api.model_copy(update={"host": "0.0.0.0"})})  # not loopback
    service = HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)
    basic = {"Authorization": "Basic " + base64.b64encode(f"ops:{service.api_token}".encode()).decode()}
    with TestClient(create_api(service), base_url="http://127.0.0.1") as client:
        assert client.get("/rounds").status_code == 401
        assert client.get("/rounds", headers=basic).json() == []
        for path, body in MUTATIONS:
            response = client.post(path, json=body, headers=basic)
            assert response.status_code == 401, (path, response.text)
            assert "Bearer" in response.json()["detail"] and "reading only" in response.json()["detail"]
        bearer = {"Authorization": f"Bearer {service.api_token}"}
        assert client.post("/rounds/r-x/cancel", headers=bearer).status_code == 409
    assert service.store.list() == []


@pytest.mark.parametrize(
    ("path", "body", "complaint"),
    [
        ("/rounds", {"window": "٣h"}, "window"),  # Arabic-Indic three: was a round over 3h
        ("/rounds", {"window": "３h"}, "window"),  # a fullwidth three
        ("/promote", {"version": "١"}, "version"),  # was a 404 from MLflow, not a 422
        ("/promote", {"version": "1", "model": ""}, "model"),
        ("/rollback", {"model": ""}, "model"),  # acted on the default model
        ("/rollback", {"to": "²"}, "to"),
        ("/rollback", {"model": "x" * 300}, "model"),
        ("/rounds", {"until": "2026-12-06T14:00:00"}, "until"),  # no time zone: whose 14:00?
        ("/rounds", {"until": 0}, "until"),  # a bare number was seconds since 1970
        ("/rounds", {"until": "yesterday"}, "until"),
        ("/rounds", {"until": "2026-12-06"}, "until"),
        ("/rounds", {"until": "2026"}, "until"),  # pydantic's datetime read digits as seconds since 1970
        ("/rounds", {"until": "1700000000"}, "until"),
        ("/rounds", {"until": "20260105T083000Z"}, "until"),
        ("/rounds", {"until": "2026-01-05T08:30:00.0005Z"}, "until"),  # finer than the buffer's milliseconds
        ("/rounds", {"until": "2026-02-30T08:30:00Z"}, "until"),
        ("/rounds", {"until": "٢٠٢٦-01-05T08:30:00Z"}, "until"),  # Arabic-Indic digits
    ],
)
def test_numbers_are_ascii_digits_and_names_are_not_empty(
    client: TestClient, service: HourglassService, path: str, body: dict, complaint: str
) -> None:
    response = client.post(path, json=body, headers={"Authorization": f"Bearer {service.api_token}"})
    assert response.status_code == 422, response.text
    assert complaint in {str(e["loc"][-1]) for e in response.json()["detail"]}
    assert service.store.list() == []


@pytest.mark.parametrize(
    ("content", "content_type", "status", "complaint"),
    [
        (b'\xef\xbb\xbf{"window": "6h"}', "application/json", 400, "byte order mark"),
        ('{"window": "6h"}'.encode("utf-16"), "application/json", 400, "byte order mark"),
        ('{"window": "6h"}'.encode("utf-16-le"), "application/json", 400, "UTF-16 or UTF-32"),
        ('{"window": "6h"}'.encode("utf-32-be"), "application/json", 400, "UTF-16 or UTF-32"),
        (b'{"window": "6h"}', "application/json; charset=utf-16", 415, "charset"),
        (b'{"window": "6\xffh"}', "application/json", 400, "not UTF-8"),
        (b'{"window": "6h", "window": "1s"}', "application/json", 400, "twice"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 413, "api.max_body_bytes"),
        (b"[" * 1000 + b"]" * 1000, "application/json", 400, "deeper"),
        (b'{"window": "\\ud800"}', "application/json", 400, "Unicode"),
    ],
)
def test_bodies_are_read_one_way_only(
    client: TestClient, service: HourglassService, content: bytes, content_type: str, status: int, complaint: str
) -> None:
    headers = {"Authorization": f"Bearer {service.api_token}", "Content-Type": content_type}
    response = client.post("/rounds", content=content, headers=headers)
    assert response.status_code == status and complaint in response.json()["detail"], response.text
    assert service.store.list() == []


@pytest.mark.parametrize(
    ("path", "content", "field"),
    [
        ("/rounds", b'{"window": NaN}', "window"),  # FastAPI's answer echoed NaN: not JSON, a 500
        ("/promote", b'{"version": "1", "model": Infinity}', "model"),
        ("/rollback", b'{"model": -Infinity}', "model"),
        ("/rounds", b'{"candidates": ["x"], "surprise": NaN}', "surprise"),
    ],
)
def test_nan_or_infinity_in_a_body_is_a_422_naming_the_field(
    client: TestClient, service: HourglassService, path: str, content: bytes, field: str
) -> None:
    headers = {"Authorization": f"Bearer {service.api_token}", "Content-Type": "application/json"}
    response = client.post(path, content=content, headers=headers)
    assert response.status_code == 422, response.text
    assert field in {str(e["loc"][-1]) for e in response.json()["detail"]}
    assert service.store.list() == []


def test_what_a_client_sent_is_quoted_back_bounded(client: TestClient, service: HourglassService) -> None:
    from pipeline.api import MAX_DETAIL_CHARS

    auth = {"Authorization": f"Bearer {service.api_token}"}
    long_id = "r" * 5000
    for response in (
        client.get(f"/rounds/{long_id}"),
        client.post(f"/rounds/{long_id}/cancel", headers=auth),
        client.post("/rounds", json={"candidates": ["c" * 60_000]}, headers=auth),
    ):
        assert response.status_code in (404, 409, 422), response.text
        assert len(response.text) < 2 * MAX_DETAIL_CHARS, (response.status_code, len(response.text))
