"""The ops CLI's HTTP client against a service that accepts connections but answers late (a service busy
training on a loaded host): a clear one-line failure instead of a traceback, and ``retrain --wait`` keeps
following its round instead of dying on one unanswered poll (seen in tests/e2e/test_e2e_tools.py at load 27)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import typer

from pipeline.cli.ops import ApiClient


@pytest.fixture
def stalling_service() -> Iterator[str]:
    """A listening socket that never accepts: connections open (the kernel's backlog), no answer ever comes."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def _client(base: str) -> ApiClient:
    client = ApiClient.__new__(ApiClient)  # no config or token file needed to talk to a socket
    client.base, client.timeout_s, client._token_fn = base, 0.3, lambda: "token"
    return client


def test_a_late_answer_is_one_clear_line_not_a_traceback(
    stalling_service: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(typer.Exit) as exited:
        _client(stalling_service).call("GET", "/rounds/r1")
    assert exited.value.exit_code == 1
    err = capsys.readouterr().err
    assert "did not answer within 0.3 s" in err and "GET /rounds/r1" in err and "Traceback" not in err


def test_a_follow_loop_polls_again_after_a_late_answer(stalling_service: str) -> None:
    assert _client(stalling_service).poll("/rounds/r1") is None


def test_a_follow_loop_stops_when_the_service_is_gone(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        base = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(typer.Exit):
        _client(base).poll("/rounds/r1")
    assert "no Hourglass service" in capsys.readouterr().err
