"""Serving an ASGI app on a real socket in tests (the gateway, fake upstreams)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from connectors.edge import EdgeLimits, server_config
from pipeline.stack import free_port


@contextmanager
def serve(app: FastAPI, what: str = "server", limits: EdgeLimits | None = None) -> Iterator[str]:
    """Run ``app`` with uvicorn in a thread on a free port, behind the request-head limits the gateway and the
    ops API are served with (:mod:`connectors.edge`); yields its base URL. Fails the test when the
    server does not start within 30 s or stop within 60 s."""
    port = free_port()
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, limits or EdgeLimits(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), f"{what} did not start within 30 s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive(), f"{what} did not stop within 60 s"
