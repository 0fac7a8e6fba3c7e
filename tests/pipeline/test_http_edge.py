"""Request heads at the edge of the real servers: ``hourglass gateway`` (its CLI entry point) and the ops API
(the server ``hourglass service`` runs), each in a process of its own, attacked on raw sockets.

Before any authentication: a 32 MiB header and 300,000 headers get 431 and the connection closes, with the
server's memory (RSS) bounded; 100 connections that trickle their headers and never finish them are closed
after ``header_timeout_s``, while a normal request still gets through; an absolute-form request target
(``GET http://evil.example/...``) is a 400. No Kafka, MLflow or vLLM is needed: nothing here gets past the
head (the gateway's broker address is a closed port; it serves without it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from pipeline.stack import free_port
from tests import REPO

HEADER_TIMEOUT_S = 2.0
MiB = 1 << 20


def _config(tmp: Path) -> tuple[Path, int, int]:
    api_port, gateway_port = free_port(), free_port()
    conf = tmp / "hourglass.toml"
    conf.write_text(
        textwrap.dedent(f"""
        state_dir = "{tmp / "state"}"
        [kafka]
        bootstrap_servers = ["127.0.0.1:{free_port()}"]
        embedded = false
        [buffer]
        root = "{tmp / "buffer"}"
        dead_letter_root = "{tmp / "dlq"}"
        [registry]
        tracking_uri = "http://127.0.0.1:{free_port()}"
        embedded = false
        [serving]
        replicas = ["http://127.0.0.1:{free_port()}"]
        embedded = false
        [gateway]
        header_timeout_s = {HEADER_TIMEOUT_S}
        [api]
        port = {api_port}
        gateway_port = {gateway_port}
        header_timeout_s = {HEADER_TIMEOUT_S}
        """)
    )
    return conf, api_port, gateway_port


API_SCRIPT = """
import sys
from pipeline.api import create_api
from pipeline.config import load_config
from pipeline.service import HourglassService, _api_server
cfg = load_config(sys.argv[1])
service = HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)
_api_server(create_api(service), cfg).run()
"""


def _start(argv: list[str], url: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited: {log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    pytest.fail(f"server did not start: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module", params=["gateway", "api"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, int]]:
    """(which, port, pid) of the real gateway or ops API server."""
    tmp = tmp_path_factory.mktemp(request.param)
    conf, api_port, gateway_port = _config(tmp)
    if request.param == "gateway":
        argv, port = [sys.executable, "-m", "pipeline.cli.gateway", "gateway", "--config", str(conf)], gateway_port
    else:
        argv, port = [sys.executable, "-c", API_SCRIPT, str(conf)], api_port
    proc = _start(argv, f"http://127.0.0.1:{port}", tmp / "server.log")
    try:
        yield request.param, port, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _path(which: str) -> bytes:
    return b"/v1/models" if which == "gateway" else b"/status"


def _exchange(port: int, head: bytes, *, chunk: int = 256 * 1024, timeout_s: float = 60) -> bytes:
    """Send ``head`` (in chunks, from a thread, stopping when the server closes) and read what the server
    answers until it closes the connection; returns the answer's bytes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)

    def send() -> None:
        try:
            for i in range(0, len(head), chunk):
                sock.sendall(head[i : i + chunk])
        except OSError:
            pass  # the server closed the connection mid-head: what it answered is what counts

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    answer = b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    except OSError:
        pass
    finally:
        sock.close()
        sender.join(timeout_s)
    return answer


def _status(answer: bytes) -> int | None:
    line = answer.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) >= 2 and line[1].isdigit() else None


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_oversized_heads_get_431_before_authentication_and_memory_stays_bounded(server) -> None:
    which, port, pid = server
    url = f"http://127.0.0.1:{port}{_path(which).decode()}"
    httpx.get(url, timeout=30)  # warm: the first request's imports are not the attack's cost
    before = _rss(pid)
    line = b"GET " + _path(which) + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    huge = line + b"X-Filler: " + b"a" * (32 * MiB) + b"\r\n\r\n"
    many = line + b"X-A: b\r\n" * 300_000 + b"\r\n"
    for head in (huge, many, huge, many):
        answer = _exchange(port, head)
        assert _status(answer) == 431, answer[:300]
        assert b"connection: close" in answer.lower()
    grown = _rss(pid) - before
    assert grown < 24 * MiB, f"the server grew by {grown / MiB:.0f} MiB reading refused heads"
    normal = httpx.get(url, timeout=30)
    assert normal.status_code in (200, 401), normal.text  # 401: the gateway's key check, only now reached


def test_heads_that_never_complete_are_closed_and_others_are_served(server) -> None:
    which, port, pid = server
    url = f"http://127.0.0.1:{port}{_path(which).decode()}"
    before = _rss(pid)
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(100)]
    started = time.monotonic()
    closed_at: dict[int, float] = {}
    answers: dict[int, bytes] = {}
    for s in socks:
        s.sendall(b"GET " + _path(which) + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        s.setblocking(False)
    served = None
    # slowloris: one more header byte per connection every 0.5 s (an idle timer reset by each byte never fires)
    while time.monotonic() - started < HEADER_TIMEOUT_S + 6 and len(closed_at) < len(socks):
        if served is None and time.monotonic() - started > HEADER_TIMEOUT_S / 2:
            served = httpx.get(url, timeout=30)  # a normal client while 100 heads hang
        for i, s in enumerate(socks):
            if i in closed_at:
                continue
            try:
                data = s.recv(4096)
                if data:
                    answers[i] = answers.get(i, b"") + data
                    continue
                closed_at[i] = time.monotonic() - started
                continue
            except BlockingIOError:
                pass
            except OSError:
                closed_at[i] = time.monotonic() - started
                continue
            try:
                s.send(b"X")
            except BlockingIOError:
                pass
            except OSError:
                closed_at[i] = time.monotonic() - started
        time.sleep(0.5)
    for s in socks:
        s.close()
    assert served is not None and served.status_code in (200, 401), served
    assert len(closed_at) == len(socks), f"{len(socks) - len(closed_at)} of 100 half-open connections still open"
    assert max(closed_at.values()) < HEADER_TIMEOUT_S + 3, sorted(closed_at.values())[-5:]
    assert all(_status(a) == 408 for a in answers.values()), {_status(a) for a in answers.values()}
    assert _rss(pid) - before < 24 * MiB


def test_an_absolute_form_target_is_a_400(server) -> None:
    which, port, _ = server
    answer = _exchange(port, b"GET http://evil.example" + _path(which) + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert _status(answer) == 400, answer[:300]
    assert b"origin-form" in answer


@pytest.mark.parametrize(
    ("extra", "complaint"),
    [
        (
            b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"both transfer-encoding and content-length",
        ),
        (
            b"Authorization: Basic eDp5\r\nAuthorization: Bearer x\r\nContent-Length: 0\r\n\r\n",
            b"2 authorization headers",
        ),
        (b"Origin: http://127.0.0.1\r\nOrigin: http://evil.example\r\nContent-Length: 0\r\n\r\n", b"2 origin headers"),
        (
            b"Content-Type: application/json\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}",
            b"2 content-type headers",
        ),
    ],
)
def test_a_head_two_parsers_could_read_two_ways_is_a_400(server, extra: bytes, complaint: bytes) -> None:
    """Found by an attacker's pass: Content-Length with Transfer-Encoding was served (framed by the latter, while a
    proxy in front may frame by the former), and of two Origin or Content-Type headers the first was read."""
    which, port, _ = server
    path = b"/v1/chat/completions" if which == "gateway" else b"/rounds"
    answer = _exchange(port, b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra)
    assert _status(answer) == 400 and complaint in answer.lower(), answer[:300]
