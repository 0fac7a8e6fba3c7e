"""Helpers of the end-to-end tests: start ``hourglass service`` / ``gateway`` as an operator does (a subprocess
on the test's config), wait for a condition with the services' log tails on failure, run an ops CLI command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from pipeline.stack import tail

T = TypeVar("T")


def spawn(command: str, conf: Path, log: Path) -> subprocess.Popen[bytes]:
    """``hourglass COMMAND --config CONF`` in its own process group, its output appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", command, "--config", str(conf)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=os.environ,
        )


def wait_for(predicate: Callable[[], T | None], what: str, timeout_s: float, logs: list[Path]) -> T:
    """The first truthy value of ``predicate()`` (polled every second; an HTTP error counts as not yet); the test
    fails with the tails of ``logs`` when none comes within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(1)
    pytest.fail(f"timed out waiting for {what}\n" + "\n".join(f"--- {p.name}\n{tail(p, 40)}" for p in logs))


def ops_cli(conf: Path, *args: str, timeout_s: float) -> Any:
    """``hourglass ARGS --config CONF --json`` as an operator runs it; its JSON output (the command must succeed)."""
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args, "--config", str(conf), "--json"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=os.environ,
    )
    assert done.returncode == 0, f"hourglass {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)
