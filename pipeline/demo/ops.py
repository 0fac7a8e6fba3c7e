"""The demo's calls to the processes it starts: spawn the service and the gateway, wait for them, start and
follow rounds through the ops API, promote a challenger by hand, read which vLLM name serves a model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_fixed

from pipeline import stack
from pipeline.config import HourglassConfig

console = Console(soft_wrap=True)


@retry(retry=retry_if_exception_type(httpx.HTTPError), wait=wait_fixed(5), stop=stop_after_delay(300), reraise=True)
def get(url: str, **params: Any) -> Any:
    """GET a JSON view of the ops API; retried for up to 5 min (tenacity): under load, a round's
    training can keep the service from answering within the timeout."""
    response = httpx.get(url, params=params or None, timeout=30)
    response.raise_for_status()
    return response.json()


def spawn(
    name: str, args: list[str], cfg: HourglassConfig, config: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``python -m pipeline.cli ARGS --config CONFIG`` in its own process group, its output in
    ``<state_dir>/run/NAME.log``; ``env``: settings added to this process's environment (``HOURGLASS_*``)."""
    log = (stack.run_dir(cfg.state_dir) / f"{name}.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", *args, "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=None if env is None else {**os.environ, **env},
    )


def wait_http(url: str, what: str, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with code {proc.returncode}; see its log under .hourglass/run/")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{what} did not answer {url} within {timeout_s:.0f}s")


def start_round(api: str, token: str, **body: Any) -> str:
    """Start a round through the ops API (``POST /rounds``, ``body``: e.g. ``candidates``, ``until``); returns
    its id."""
    body = {k: v.isoformat(timespec="milliseconds") if isinstance(v, datetime) else v for k, v in body.items()}
    response = httpx.post(f"{api}/rounds", json=body, headers={"authorization": f"Bearer {token}"}, timeout=120)
    response.raise_for_status()
    return response.json()["round_id"]


def wait_round(api: str, round_id: str, timeout_s: float) -> dict[str, Any]:
    """The round ``round_id`` once it has ended, its state changes printed as they come."""
    deadline = time.monotonic() + timeout_s
    shown = None
    while time.monotonic() < deadline:
        record = get(f"{api}/rounds/{round_id}")
        if record["state"] != shown:
            console.print(f"  [dim]{time.strftime('%H:%M:%S')} round {round_id}: {record['state']}[/]")
            shown = record["state"]
        if record["state"] in ("done", "no_winner", "failed", "cancelled"):
            return record
        time.sleep(3)
    raise SystemExit(f"round {round_id} did not end within {timeout_s:.0f}s")


def served_name(cfg: HourglassConfig, served_model: str) -> str | None:
    """The vLLM model name that serves ``served_model`` now (its route in ``routes.json``), None while no
    version does (the base serves it, or nothing does)."""
    routes_file = cfg.resolve(cfg.state_dir) / "routes.json"
    route = (json.loads(routes_file.read_text()) if routes_file.exists() else {}).get(served_model, {})
    return route.get("served_name") if route.get("served_name") and route.get("version") else None


def promote_by_hand(api: str, token: str, model: str, reason: str) -> str | None:
    """A served model with no users (the oracle, the explicit-only line) could never decide its canary: promote
    its challenger by hand (ops API), its first winner too (no champion: its canary would compare it with the
    base, on no traffic either), with ``reason`` recorded on the version (``hourglass.canary_result``).
    Returns the promoted version, None when nothing was on canary."""
    look = get(f"{api}/canary").get(model) or {}
    if not look.get("canary"):
        return None
    httpx.post(
        f"{api}/canary/{model}/promote",
        params={"reason": reason},
        headers={"authorization": f"Bearer {token}"},
        timeout=120,
    ).raise_for_status()
    return str(look["canary"]["version"])
