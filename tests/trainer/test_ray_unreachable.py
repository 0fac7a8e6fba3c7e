"""Ray unreachable at round start is a clear error within the connect timeout, not a hang.

No cluster here (this module does not use the ``ray_cluster`` fixture): an address nobody
listens on is refused at once; an address that accepts TCP but never speaks Ray fails
after ``rl.ray.connect_timeout_s``."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from pipeline.stack import free_port
from trainer.config import CandidateConfig, ModelConfig, RLConfig
from trainer.errors import ExecutorUnavailableError
from trainer.types import TrainJob
from trainer.executors.executor import make_executor


def _job(tmp_path: Path, address: str) -> TrainJob:
    rl = RLConfig(executor="ray", ray={"address": address, "connect_timeout_s": 2})
    return TrainJob(
        ModelConfig(name="unused"), (CandidateConfig(name="a", start="fresh"),), (), rl, {}, tmp_path, "r-unreachable"
    )


def test_ray_unreachable_is_a_clear_error_fast(tmp_path: Path) -> None:
    import ray

    assert not ray.is_initialized()
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(
        ExecutorUnavailableError,
        match=rf"Ray cluster at rl.ray.address='{address}' is unreachable .*ConnectionRefusedError",
    ):
        make_executor(_job(tmp_path, address).rl).train(_job(tmp_path, address), None, None, None)
    assert time.monotonic() - started < 3

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(
            ExecutorUnavailableError,
            match=rf"rl.ray.address='{address}' (did not answer within rl.ray.connect_timeout_s=2s|.*cannot connect)",
        ):
            make_executor(_job(tmp_path, address).rl).train(_job(tmp_path, address), None, None, None)
        assert time.monotonic() - started < 10
