"""Helpers of the connectors tests (``from tests.connectors.connector_helpers import wait_for``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until true; fail the test naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
