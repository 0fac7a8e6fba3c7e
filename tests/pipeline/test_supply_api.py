"""The ops API and the service as an attacker sees them: auth before the body,
Host checks, tokens on reads off loopback, no credentials in what is served or
logged, and production secrets refused at start-up."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pipeline.api import CACHE_S, create_api, host_allowed
from pipeline.config import HourglassConfig, load_config
from pipeline.errors import ConfigError
from pipeline.redact import redact
from pipeline.service import HourglassService

SECRET = "S3cretPW"
CRED_URI = (
    f"http://alice:{SECRET}@127.0.0.1:1"  # nothing listens on port 1: every call fails, with the URI in the error
)
REPLICA = "http://bob:R3plicaPW@127.0.0.1:9"


def _service(tmp_path: Path, **api) -> HourglassService:
    base = load_config(None)
    cfg = base.model_copy(update={"state_dir": str(tmp_path), "api": base.api.model_copy(update=api)})
    return HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)


@pytest.fixture
def service(tmp_path: Path) -> HourglassService:
    return _service(tmp_path)


@pytest.fixture
def client(service: HourglassService) -> Iterator[TestClient]:
    with TestClient(create_api(service), base_url="http://127.0.0.1:18080") as test_client:
        yield test_client


def test_auth_is_checked_before_the_body_is_parsed(client: TestClient, service: HourglassService) -> None:
    malformed = {"content": b'{"version": "1",,,', "headers": {"Content-Type": "application/json"}}
    for path in ("/promote", "/rollback", "/rounds"):
        response = client.post(path, **malformed)
        assert response.status_code == 401, (path, response.text)
        assert response.headers["WWW-Authenticate"] == "Bearer"
        wrong = client.post(
            path, content=malformed["content"], headers={**malformed["headers"], "Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 403, path
        right = client.post(
            path,
            content=malformed["content"],
            headers={**malformed["headers"], "Authorization": f"Bearer {service.api_token}"},
        )
        assert right.status_code == 400 and "not valid JSON" in right.json()["detail"], (
            path
        )  # only now is the body read
    assert service.store.list() == []


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:18080",
        "attacker.localhost",
        "",
        "[::1]evil.example",
        "[::1]:x",
        "[::1",
        # found by a red-team pass: each was allowed
        "localhost:x",
        "[localhost]:18080",
    ],
)
def test_foreign_host_header_is_refused(client: TestClient, host: str) -> None:
    for path in ("/status", "/rounds", "/healthz"):
        response = client.get(path, headers={"Host": host})
        assert response.status_code == 421, (host, path)
        assert "Host header" in response.json()["detail"]


def test_host_check_strips_only_http_whitespace() -> None:
    """Found by a red-team pass: str.strip() also ate a no-break space, so "localhost\\xa0" (a Host header
    is read as Latin-1) counted as localhost."""
    names = {"localhost"}
    assert host_allowed("\tlocalhost ", names) and host_allowed("localhost:", names)
    assert not host_allowed("localhost\xa0", names) and not host_allowed("\x85localhost", names)
    assert not host_allowed("localhost:\xb2", names) and not host_allowed("[::1]:\xb2", names)  # "²".isdigit()


@pytest.mark.parametrize(
    "hosts", [["127.0.0.1:18080", "evil.example"], ["evil.example", "127.0.0.1:18080"], ["localhost", "localhost"]]
)
def test_two_host_headers_are_refused(client: TestClient, service: HourglassService, hosts: list[str]) -> None:
    auth = ("Authorization", f"Bearer {service.api_token}")
    for path in ("/status", "/healthz"):
        response = client.get(path, headers=[("Host", h) for h in hosts])
        assert response.status_code == 400, (hosts, path)  # was 200 when the first one was allowed
        assert "2 Host headers" in response.json()["detail"]
    rounds = client.post("/rounds", json={}, headers=[*(("Host", h) for h in hosts), auth])
    assert rounds.status_code == 400 and service.store.list() == []


@pytest.mark.parametrize("host", ["127.0.0.1:18080", "localhost", "[::1]:18080", "10.1.2.3:18080"])
def test_loopback_names_and_ip_literals_are_accepted(client: TestClient, host: str) -> None:
    assert client.get("/healthz", headers={"Host": host}).status_code == 200


def test_off_loopback_reads_need_the_token(tmp_path: Path) -> None:
    service = _service(tmp_path, host="0.0.0.0", allowed_hosts=["ops.internal"])
    auth = {"Authorization": f"Bearer {service.api_token}"}
    with TestClient(create_api(service), base_url="http://ops.internal:18080") as client:
        for path in ("/status", "/rounds", "/rounds/r-x", "/buffer/stats", "/openapi.json"):
            response = client.get(path)
            assert response.status_code == 401, path
            assert "not on loopback" in response.json()["detail"]
            assert client.get(path, headers={"Authorization": "Bearer nope"}).status_code == 403, path
        assert client.get("/status", headers=auth).status_code == 200
        assert client.get("/rounds", headers=auth).json() == []
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/metrics").status_code == 200
        bare = client.get("/readyz").json()
        assert set(bare) == {"ready"}  # no details (URLs, hosts) without the token
        assert "checks" in client.get("/readyz", headers=auth).json()
        assert client.get("/status", headers={"Host": "other.internal"}).status_code == 421


def test_expensive_status_is_cached(
    client: TestClient, service: HourglassService, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = service.buffer_stats

    def counted():
        calls.append(1)
        return real()

    monkeypatch.setattr(service, "buffer_stats", counted)
    for _ in range(5):
        assert client.get("/buffer/stats").status_code == 200
        assert client.get("/metrics").status_code == 200  # the buffer gauge shares nothing but the cost rule
    assert len(calls) == 2  # one for /buffer/stats, one for the gauges of /metrics
    time.sleep(CACHE_S + 0.1)
    assert client.get("/buffer/stats").status_code == 200
    assert len(calls) == 3  # fresh again after the TTL


def test_credentials_never_reach_status_rounds_or_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from pipeline.serving.controller import ServingController

    base = load_config(None)
    cfg = base.model_copy(
        update={
            "state_dir": str(tmp_path),
            "registry": base.registry.model_copy(update={"tracking_uri": CRED_URI, "embedded": False}),
            "serving": base.serving.model_copy(update={"replicas": [REPLICA], "embedded": False}),
        }
    )
    service = HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)
    service.controller = ServingController(cfg, base_fingerprint="f" * 64)
    caplog.set_level(logging.INFO)
    raw = service.controller.reconcile_once()  # MLflow unreachable: the error names the tracking URI
    assert SECRET in str(raw), "precondition: the raw controller status carries the credentials"

    # A round that failed because MLflow was unreachable, stored the way RoundRunner stores it.
    record = service.store.create("api", ["default"], "1h")
    logging.getLogger("pipeline.rounds.job").error(
        "round %s failed: MLflow at %s is unreachable", record.round_id, CRED_URI
    )
    service.store.transition(
        record, "failed", f"register: RegistryUnavailableError: MLflow at {CRED_URI} is unreachable"
    )
    try:
        raise ConnectionError(f"could not reach {CRED_URI}/api/2.0")
    except ConnectionError:
        logging.getLogger("pipeline.service").exception("reconcile failed")

    with TestClient(create_api(service), base_url="http://localhost") as client:
        status = client.get("/status").text
        rounds = client.get("/rounds").text
        one = client.get(f"/rounds/{record.round_id}").text
    for text in (status, rounds, one):
        assert SECRET not in text and "R3plicaPW" not in text
    assert "http://***@127.0.0.1:1" in rounds and "***@127.0.0.1" in status
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert "http://***@127.0.0.1:1" in logged  # the records were made, and masked
    assert SECRET not in logged and "R3plicaPW" not in logged
    assert SECRET not in caplog.text
    assert SECRET not in (tmp_path / "rounds.sqlite").read_bytes().decode("latin-1")  # nor stored


def test_redact_masks_userinfo_and_secret_query_values() -> None:
    assert redact("http://alice:S3cretPW@host:5000/x") == "http://***@host:5000/x"
    assert redact("postgresql://mlflow:pw@postgres:5432/mlflow") == "postgresql://***@postgres:5432/mlflow"
    assert (
        redact("https://s3/x?X-Amz-Signature=abc&page=2&token=t") == "https://s3/x?X-Amz-Signature=***&page=2&token=***"
    )
    assert redact("http://host:5000/health and a=b") == "http://host:5000/health and a=b"


def test_production_service_refuses_default_or_placeholder_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError) as err:
        HourglassService(
            HourglassConfig(state_dir=str(tmp_path), deployment="production"),
            base_fingerprint="f" * 64,
            ingest=False,
            reconcile=False,
        )
    message = str(err.value)
    assert "buffer.user_hash_key" in message and "registry.signing_key" in message
    monkeypatch.setenv("HOURGLASS_BUFFER__USER_HASH_KEY", "change-me-openssl-rand-hex-32")
    monkeypatch.setenv("HOURGLASS_REGISTRY__SIGNING_KEY", "0123456789abcdef" * 4)
    with pytest.raises(ConfigError, match="buffer.user_hash_key .*placeholder"):
        HourglassService(
            HourglassConfig(state_dir=str(tmp_path), deployment="production"),
            base_fingerprint="f" * 64,
            ingest=False,
            reconcile=False,
        )
    monkeypatch.setenv("HOURGLASS_BUFFER__USER_HASH_KEY", "fedcba9876543210" * 2)
    ok = HourglassService(
        HourglassConfig(state_dir=str(tmp_path), deployment="production"),
        base_fingerprint="f" * 64,
        ingest=False,
        reconcile=False,
    )
    assert ok.cfg.deployment == "production"
    # the embedded default starts with no secret set at all
    assert HourglassService(
        HourglassConfig(state_dir=str(tmp_path / "e")), base_fingerprint="f" * 64, ingest=False, reconcile=False
    )


class _FakeVllm:
    """A local HTTP server answering like vLLM with a canned completion; records the Authorization headers."""

    def __init__(self, completion: dict) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen = self.auth = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: dict) -> None:
                seen.append(self.headers.get("Authorization"))
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._answer({"data": [{"id": "base"}]})

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer(completion)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def _completion(text: str, logprobs: list) -> dict:
    return {"model": "m-v1", "choices": [{"text": text, "logprobs": {"token_logprobs": logprobs}}]}


@pytest.mark.parametrize(
    ("completion", "refusal"),
    [
        (_completion(" world and more", [-0.5, -1.25, -2.0]), None),
        (_completion("", []), "generated nothing"),
        (_completion(" x", [-0.5, float("nan")]), "non-finite logprobs"),
        (_completion(" x", [-0.5, None]), "non-finite logprobs"),
        ({"model": "m-v1", "choices": []}, "without a completion"),
    ],
    ids=["healthy", "empty", "nan", "null", "no-choices"],
)
def test_probe_refuses_a_broken_adapter_and_sends_the_vllm_key(completion, refusal) -> None:
    from pipeline.serving.replica import PROBE_TOKENS, Replica, ReplicaRefusedError

    assert PROBE_TOKENS >= 16
    fake = _FakeVllm(completion)
    replica = Replica(fake.url, api_key="vllm-key-123")
    try:
        assert replica.models() == ["base"]
        if refusal is None:
            assert replica.probe("m-v1") == " world and more"
        else:
            with pytest.raises(ReplicaRefusedError, match=refusal):
                replica.probe("m-v1")
    finally:
        replica.close()
        fake.close()
    assert fake.auth == ["Bearer vllm-key-123", "Bearer vllm-key-123"]


def test_a_basic_credential_that_is_not_base64_text_is_a_401_not_a_500() -> None:
    """Red-team finding: a non-ASCII Basic credential made base64 decoding raise a plain ValueError (500)."""
    from starlette.requests import Request

    from pipeline.console import presented_token

    request = Request({"type": "http", "headers": [(b"authorization", b"Basic \xff\xfe")]})
    assert presented_token(request) is None


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/promote", {"version": "9" * 400}),  # MLflow answered 500 (int64 overflow) until its client gave up: 502
        ("/rollback", {"to": "99999999999999999999"}),
    ],
)
def test_a_version_number_mlflow_cannot_hold_is_refused_before_asking_it(
    client: TestClient, service: HourglassService, path: str, body: dict
) -> None:
    response = client.post(path, json=body, headers={"Authorization": f"Bearer {service.api_token}"})
    assert response.status_code in (404, 422), response.text
    assert "MLflow" not in response.text and "version" in response.text


def test_an_invalid_model_name_from_mlflow_is_the_callers_fault() -> None:
    from fastapi import HTTPException
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    from pipeline.api_errors import registry_call

    def call() -> dict:
        raise MlflowException("Invalid model name 'a/b'. Names cannot contain '/' or ':'.", INVALID_PARAMETER_VALUE)

    with pytest.raises(HTTPException) as refused:
        registry_call(call)
    assert refused.value.status_code == 422 and "Invalid model name" in str(refused.value.detail)  # was 502
