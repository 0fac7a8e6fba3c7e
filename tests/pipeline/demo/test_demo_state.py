"""The demo starts from nothing: a previous run's state (champion, routes, buffer) would otherwise serve
"before round 1" and every figure after it would mix two runs."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import typer

from pipeline.config import load_config
from pipeline.demo.main import DEMO_MARKER, _fresh_state
from tests import REPO


def _cfg(tmp_path: Path, state: Path):
    cfg = load_config(REPO / "deploy" / "demo.toml")
    return cfg.model_copy(update={"state_dir": str(state)})


def test_a_previous_demo_s_state_is_removed_and_a_fresh_one_marked(tmp_path: Path) -> None:
    state = tmp_path / "demo"
    cfg = _cfg(tmp_path, state)
    _fresh_state(cfg)  # nothing yet: made and marked
    assert (state / DEMO_MARKER).exists()
    (state / "routes.json").write_text('{"hourglass": {"version": "3", "served_name": "hourglass-v3"}}')
    (state / "registry").mkdir()
    _fresh_state(cfg)
    assert sorted(p.name for p in state.iterdir()) == [DEMO_MARKER]


def test_a_state_folder_the_demo_did_not_make_is_refused_and_kept(tmp_path: Path) -> None:
    state = tmp_path / "production"
    state.mkdir()
    (state / "rounds.sqlite").write_text("a service's rounds")
    with pytest.raises(typer.BadParameter, match="holds files the demo did not make"):
        _fresh_state(_cfg(tmp_path, state))
    assert (state / "rounds.sqlite").read_text() == "a service's rounds"


def test_a_demo_left_running_is_not_wiped_under_its_feet(tmp_path: Path) -> None:
    state = tmp_path / "demo"
    cfg = _cfg(tmp_path, state)
    _fresh_state(cfg)
    (state / "routes.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = cfg.model_copy(update={"api": cfg.api.model_copy(update={"port": busy.getsockname()[1]})})
        with pytest.raises(typer.BadParameter, match="in use"):
            _fresh_state(cfg)
    assert (state / "routes.json").exists()
