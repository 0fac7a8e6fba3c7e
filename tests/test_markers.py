"""The markers of the suite come from the fixtures a test uses (tests/conftest.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.stack import Service, free_port, http_ok
from tests import conftest


class _Item:
    def __init__(self, *fixtures: str) -> None:
        self.fixturenames = list(fixtures)
        self.markers: list[str] = []

    def add_marker(self, marker: str) -> None:
        self.markers.append(marker)


def test_service_and_model_fixtures_give_their_markers() -> None:
    broker, vllm, model, plain = (
        _Item("kafka_cfg", "broker"),
        _Item("vllm_tiny", "tiny_model", "smollm2_model"),
        _Item("peaked_model", "tiny_model", "smollm2_model"),
        _Item("tmp_path"),
    )
    conftest.pytest_collection_modifyitems([broker, vllm, model, plain])  # type: ignore[list-item]
    assert broker.markers == ["broker", "integration"]
    assert vllm.markers == ["vllm", "integration", "model"]
    assert model.markers == ["model"]
    assert plain.markers == []
    per_arch = _Item("vllm_arch", "arch_model", "tiny_model", "smollm2_model", "services_dir")
    conftest.pytest_collection_modifyitems([per_arch])  # type: ignore[list-item]
    assert per_arch.markers == ["vllm", "integration", "model"]


def test_a_test_without_the_marker_cannot_start_a_service(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    service = Service("web", argv, "127.0.0.1", port, http_ok(f"http://127.0.0.1:{port}/"), tmp_path)
    with pytest.raises(pytest.fail.Exception, match="starts web but is not marked integration"):
        service.start()
    assert not service.pid_path.exists()  # nothing was started
