"""The scoreboard's explicit-only line: the same run's traffic, learned from its explicit ratings alone.

Below a rating rate of 1 the demo's users rate a few answers and otherwise only behave, and the served model
learns from both. What the implicit signals add is measured, not assumed: after the scoreboard the demo
replays the run's rounds on the same traffic with the implicit signals off (``buffer.implicit.enabled =
false``), through a second service process with its own state folder, MLflow experiment and served model
(:data:`EXPLICIT_MODEL`: its own registry entries, reward model and champion; the same candidates, recipe,
gate and budgets). Replayed round i reads the window that ended when live round i started (``POST /rounds``
with ``until``), so it learns from the traffic live round i learned from: the same answers, rated as the
users rated them. Its served model has no users, so its canary could never decide: its winners are promoted
by hand, like the oracle's. The line is its final champion's greedy accuracy on the same fresh prompts (the
base's when it promoted none).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rich.markup import escape

from pipeline.config import HourglassConfig
from pipeline.demo.ops import console, promote_by_hand, served_name, spawn, start_round, wait_http, wait_round
from pipeline.state_secrets import api_token

EXPLICIT_MODEL = "hourglass-explicit"  # the explicit-only line's served model (no users)
EXPLICIT_REASON = (
    "the explicit-only line serves no users, so no live evidence can decide its canary; a reference for the scoreboard"
)


@dataclass(frozen=True)
class LiveRound:
    """What the replay needs of one live round: when it started (its window's end) and the rows it read."""

    started: datetime
    rows: int | None


@dataclass(frozen=True)
class Replayed:
    """One replayed round: the version promoted by hand (None: none won), the rows it read, its reason."""

    state: str
    promoted: str | None
    rows: int | None
    reason: str


def replay_settings(cfg: HourglassConfig) -> dict[str, str]:
    """The replay service's settings over the demo's config (``HOURGLASS_*``): its own state folder, served
    model and experiment, and no implicit signals in its snapshots."""
    return {
        "HOURGLASS_STATE_DIR": str(cfg.resolve(cfg.state_dir) / "explicit-only"),
        "HOURGLASS_SERVING__MODEL_NAME": EXPLICIT_MODEL,
        "HOURGLASS_REGISTRY__EXPERIMENT": f"{cfg.registry.experiment}-explicit-only",
        "HOURGLASS_BUFFER__IMPLICIT__ENABLED": "false",
    }


def replay_explicit_only(
    cfg: HourglassConfig,
    config: Path,
    live: list[LiveRound],
    candidates: list[str],
    procs: dict[str, subprocess.Popen[bytes]],
) -> tuple[list[Replayed], str | None]:
    """Replay ``live``'s rounds for ``candidates`` with the implicit signals off (module docstring).

    The live service must have stopped (the replay's takes its port); the replay's process joins ``procs``,
    so the caller's cleanup stops it. Returns the replayed rounds and the vLLM name that serves the
    explicit-only line's final champion (None: none was promoted, the base).
    """
    settings = replay_settings(cfg)
    state = Path(settings["HOURGLASS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    api = f"http://127.0.0.1:{cfg.api.port}"
    procs["explicit-only service"] = proc = spawn("service-explicit-only", ["service"], cfg, config, settings)
    wait_http(f"{api}/healthz", "the explicit-only service", proc)
    replay_cfg = cfg.model_copy(update={"state_dir": str(state)})
    token = api_token(replay_cfg)
    out: list[Replayed] = []
    final: str | None = None
    for i, round_ in enumerate(live, 1):
        record = wait_round(api, start_round(api, token, candidates=candidates, until=round_.started), timeout_s=1800)
        reason = str(record.get("reason") or "")
        promoted = None
        if f"{EXPLICIT_MODEL} v" in reason and "on canary" in reason:
            promoted = promote_by_hand(api, token, EXPLICIT_MODEL, EXPLICIT_REASON)
        rows = (record.get("metrics") or {}).get("data/rows")
        done = Replayed(record["state"], promoted, int(rows) if rows is not None else None, reason)
        out.append(done)
        read = f"{done.rows} rows (the live round read {round_.rows})" if done.rows is not None else "no rows"
        console.print(
            f"replayed round {i} (the window until {round_.started:%H:%M:%S} UTC, {read}): {done.state}; "
            + (f"{EXPLICIT_MODEL} v{promoted} promoted by hand" if promoted else escape(reason[:300]))
        )
        if promoted:
            final = _wait_route(replay_cfg, promoted) or final
    return out, final


def _wait_route(cfg: HourglassConfig, version: str, timeout_s: float = 120.0) -> str | None:
    """The vLLM name serving :data:`EXPLICIT_MODEL` once its route names ``version`` (the reconcile loop hot-loads
    it), None if it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        name = served_name(cfg, EXPLICIT_MODEL)
        if name is not None and name.endswith(f"-v{version}"):
            return name
        time.sleep(1)
    console.print(f"[yellow]{EXPLICIT_MODEL} v{version} was not served within {timeout_s:.0f} s[/]")
    return None
