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
