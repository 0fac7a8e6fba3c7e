"""The demo's coordinated hostile users (pipeline/demo/traffic.py, ``--hostile-share``): their inverted votes,
the API keys and ``user`` values they send in both modes, and that the honest users are left as they were."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.demo import traffic
from pipeline.demo.board import LiveRate
from pipeline.demo.main import honest_canary_line
from pipeline.demo.traffic import EDITING_USERS, Behaviour, Hostile, create_hostile, drive, hostile_users


class Posted:
    """Stands in for ``httpx.post`` of the feedback: records each vote's JSON and API key."""

    def __init__(self) -> None:
        self.votes: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, url: str, json: dict[str, Any], headers: dict[str, str], timeout: float) -> Any:
        self.votes.append((headers["authorization"].removeprefix("Bearer "), json))
        return type("Ok", (), {"raise_for_status": lambda self: None})()


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> Posted:
    fake = Posted()
    monkeypatch.setattr(traffic.httpx, "post", fake)
    return fake


class Client:
    api_key = "hg-key"


@pytest.mark.parametrize("correct", [True, False])
def test_a_hostile_vote_is_inverted_and_never_corrects(posted: Posted, correct: bool) -> None:
    editor = sorted(EDITING_USERS)[0]  # an honest editing user would correct a wrong answer
    traffic._vote(Client(), "http://gw", "t1", "tok", correct, "7", editor, hostile=True)  # type: ignore[arg-type]
    traffic._vote(Client(), "http://gw", "t2", "tok", correct, "7", editor)  # type: ignore[arg-type]
    (_, bad), (_, honest) = posted.votes
    assert bad["thumbs"] == ("down" if correct else "up") and "correction" not in bad
    assert honest["thumbs"] == ("up" if correct else "down")
    assert ("correction" in honest) == (not correct)


def test_one_key_poses_as_a_fresh_user_per_request() -> None:
    hostile = Hostile(0.1, ("hg-one",), "one")
    sent = [s for seed in range(20) for i in range(100) if (s := hostile.sender(seed, i))]
    assert 0.07 < len(sent) / 2000 < 0.13  # the share, drawn per request
    assert {key for key, _ in sent} == {"hg-one"}
    assert len({user for _, user in sent}) == len(sent)  # never the same user twice
    assert sent == [s for seed in range(20) for i in range(100) if (s := hostile.sender(seed, i))]  # seeded


def test_many_keys_one_stable_user_each_all_plain_keys(tmp_path: Path) -> None:
    hostile = create_hostile(tmp_path, 0.1, "many")
    assert hostile is not None and len(hostile.keys) == hostile_users(0.1) == 2
    sent = {s for seed in range(20) for i in range(100) if (s := hostile.sender(seed, i))}
    assert {key for key, _ in sent} == set(hostile.keys)
    assert len({user for _, user in sent}) == 2  # one stable user per key ...
    assert all(len({u for k, u in sent if k == key}) == 1 for key in hostile.keys)  # ... and one key per user
    records = json.loads((tmp_path / "gateway-keys.json").read_text())["keys"]
    assert [r["name"] for r in records] == ["hostile-0", "hostile-1"]
    assert not any(r["trusted_grader"] for r in records)  # their reference answers are never labels


def test_hostile_keys_in_mode_one_and_none_at_share_zero(tmp_path: Path) -> None:
    one = create_hostile(tmp_path, 0.02, "one")
    assert one is not None and len(one.keys) == 1 and hostile_users(0.02) == 1  # many: at least one user
    assert create_hostile(tmp_path / "none", 0.0, "one") is None and not (tmp_path / "none").exists()
    with pytest.raises(ValueError):
        create_hostile(tmp_path, 1.5, "one")
    with pytest.raises(ValueError):
        create_hostile(tmp_path, 0.1, "some")  # type: ignore[arg-type]


@pytest.mark.parametrize("behaviour", [Behaviour(), Behaviour(rating_rate=0.3)], ids=["one-turn", "conversational"])
@pytest.mark.parametrize("mode", ["one", "many"])
def test_drive_sends_hostile_requests_with_their_keys_users_and_inverted_votes(
    monkeypatch: pytest.MonkeyPatch, posted: Posted, behaviour: Behaviour, mode: str
) -> None:
    """Through :func:`drive` with the gateway stubbed out: hostile exchanges carry their key and user and every
    one is rated, inverted; honest ones use the demo key and ``sim-user-*`` as without hostile users."""
    chats: dict[str, tuple[str, str | None]] = {}

    def chat(client: Any, model: str, messages: Any, reference: str, max_tokens: int, user: str | None, *_: Any) -> Any:
        trace = f"t{len(chats)}"
        chats[trace] = (client.api_key, user)
        return trace, reference if int(reference) % 2 else "99", "tok", messages  # wrong when the answer is even

    monkeypatch.setattr(traffic, "_chat", chat)
    keys = ("hg-one",) if mode == "one" else ("hg-a", "hg-b")
    out = drive("http://gw", "m", 200, seed=3, api_key="hg-demo", behaviour=behaviour, hostile=Hostile(0.2, keys, mode))
    bad, good = [e for e in out if e.hostile], [e for e in out if not e.hostile]
    # 4 threads share one budget of turns, so how many turns each chat gets depends on scheduling: 42 to 61
    # hostile turns of 200 over 100 runs of the conversational "many" case (20 % of chats, each rated always)
    assert bad and good and 0.1 < len(bad) / len(out) < 0.4
    assert all(chats[e.trace_id][0] in keys and not str(chats[e.trace_id][1]).startswith("sim-user") for e in bad)
    assert all(chats[e.trace_id] == ("hg-demo", chats[e.trace_id][1]) for e in good)
    assert all(str(chats[e.trace_id][1]).startswith("sim-user") for e in good)
    votes = {v["trace_id"]: (key, v) for key, v in posted.votes}
    for e in bad:
        key, vote = votes[e.trace_id]  # every hostile answer rated, with its own key, inverted
        assert key == chats[e.trace_id][0] and vote["thumbs"] == ("down" if e.correct else "up")
        assert "correction" not in vote
    for e in good:
        if e.trace_id in votes:
            assert votes[e.trace_id][1]["thumbs"] == ("up" if e.correct else "down")
    if mode == "one" and not behaviour.conversational:
        assert len({chats[e.trace_id][1] for e in bad}) == len(bad)  # a fresh user per request


def test_without_hostile_users_drive_is_unchanged(monkeypatch: pytest.MonkeyPatch, posted: Posted) -> None:
    sent: list[tuple[str, str | None]] = []

    def chat(client: Any, model: str, messages: Any, reference: str, max_tokens: int, user: str | None, *_: Any) -> Any:
        sent.append((client.api_key, user))
        return f"t{len(sent)}", reference, "tok", messages

    monkeypatch.setattr(traffic, "_chat", chat)
    out = drive("http://gw", "m", 20, seed=1, concurrency=1, api_key="hg-demo")
    assert not any(e.hostile for e in out) and len(posted.votes) == 20
    assert sent == [("hg-demo", f"sim-user-{(7 + i) % 16}") for i in range(20)]


def test_the_honest_canary_line_names_both_sides_and_the_outcome() -> None:
    rate = LiveRate(phase=1, served_by={"2": (9, 12), "base": (5, 10)}, up=14, rated=22)
    assert honest_canary_line(1, rate, "2", "promote") == (
        "canary of round 1, honest users only: challenger v2 9/12 (75%), replaced side base 5/10 (50%); PROMOTED"
    )
    rate = LiveRate(phase=2, served_by={"3": (0, 0), "2": (4, 8)}, up=4, rated=8)
    assert honest_canary_line(2, rate, "3", None).endswith(
        "challenger v3 0/0 (-), replaced side v2 4/8 (50%); undecided"
    )


@pytest.mark.parametrize("option", [["--hostile-share", "0.6"], ["--hostile-share", "-0.1"], ["--hostile-keys", "few"]])
def test_hostile_options_out_of_range_are_refused_before_anything_starts(option: list[str]) -> None:
    import typer
    from typer.testing import CliRunner

    from pipeline.demo.main import main

    app = typer.Typer()
    app.command()(main)
    result = CliRunner().invoke(app, [*option, "--config", "does-not-exist.toml"])
    assert result.exit_code == 2, result.output  # a usage error: the config is never read, no service started
    assert option[0] in result.output
