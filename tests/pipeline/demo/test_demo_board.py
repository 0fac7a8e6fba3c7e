"""The demo's scoreboard helpers on small tables."""

from __future__ import annotations

import math
import time
from pathlib import Path

import openai
import pyarrow as pa
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pipeline.demo.board import gains_line, live_rates, plot_live_rates
from pipeline.demo.traffic import is_correct
from trainer.rewards import first_number_answer
from tests import REPO


def test_live_rates_group_rated_rows_by_phase_and_serving_version() -> None:
    table = pa.table(
        {
            "trace_id": ["a", "b", "c", "d", "e", "f", "g", "x"],
            "adapter_version": [None, None, None, "3", "3", None, "3", "3"],
            "reward": [1.0, -1.0, None, 1.0, 1.0, -1.0, -1.0, 1.0],
        }
    )
    rates = live_rates(table, [["a", "b", "c"], ["d", "e", "f", "g"], ["h"]])
    assert [(r.up, r.rated) for r in rates] == [(1, 2), (2, 4), (0, 0)]  # c has no feedback; x was not sent by the demo
    assert rates[0].rate == 0.5 and rates[1].rate == 0.5 and math.isnan(rates[2].rate)
    assert rates[1].served_by == {"3": (2, 3), "base": (0, 1)}  # a phase may straddle a hot-load


def test_the_gains_line_gives_both_gains_and_no_ratio() -> None:
    line = gains_line(0.083, 0.708, 0.333)
    assert "feedback-only champion +0.625" in line and "oracle reference +0.250" in line
    assert "not an upper bound" in line and "/" not in line.split("(")[0]
    assert gains_line(0.083, 0.708) == "gain over the base: feedback-only champion +0.625"  # the oracle is off
    assert gains_line(0.083, None).endswith("champion +0.000 (none promoted: the base still serves)")


def test_the_explicit_only_line_says_what_the_implicit_signals_added() -> None:
    from pipeline.demo.board import explicit_only_line

    line = explicit_only_line(0.083, 0.396, 0.125, "hourglass-explicit-v2", 0.05, 3)
    assert "its 5% explicit ratings alone, 3 round(s) replayed" in line
    assert "greedy accuracy 0.125 (its champion hourglass-explicit-v2), gain over the base +0.042" in line
    assert "with the implicit signals 0.396, gain +0.313: the implicit signals add +0.271" in line
    # neither line promoted anything: both are the base, and nothing was added
    none = explicit_only_line(0.083, None, 0.083, None, 0.05, 3)
    assert "(no version promoted: the base)" in none and none.endswith("the implicit signals add +0.000")


def test_the_replay_service_has_its_own_state_model_and_experiment_and_no_implicit_signals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The explicit-only line must not share the live line's champion, reward model or registry entries (it would
    start from what the implicit signals taught), and its snapshots must carry no implicit label; the rest of the
    recipe is the demo's."""
    from pipeline.config import load_config
    from pipeline.demo.replay import EXPLICIT_MODEL, replay_settings

    demo = REPO / "deploy" / "demo.toml"
    cfg = load_config(demo).model_copy(update={"state_dir": str(tmp_path / "demo")})
    for name, value in replay_settings(cfg).items():  # what the replay's service process reads
        monkeypatch.setenv(name, value)
    replay = load_config(demo)
    assert replay.resolve(replay.state_dir) == tmp_path / "demo" / "explicit-only"
    assert replay.serving.model_name == EXPLICIT_MODEL != cfg.serving.model_name
    assert {c.served_model for c in replay.candidates} == {EXPLICIT_MODEL}  # the oracle block is commented out
    assert replay.registry.experiment == "hourglass-demo-explicit-only" != cfg.registry.experiment
    assert replay.buffer.implicit.enabled is False and cfg.buffer.implicit.enabled is True
    assert replay.buffer.root == cfg.buffer.root  # the same traffic
    assert [c.model_dump() | {"served_model": ""} for c in replay.candidates] == [
        c.model_dump() | {"served_model": ""} for c in cfg.candidates
    ]
    assert replay.rl == cfg.rl


def test_the_demo_asks_for_a_replay_in_a_form_the_api_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay's window end goes out as ISO 8601 to the millisecond: the API refuses finer times."""
    from datetime import datetime, timezone

    import httpx

    from pipeline.demo import ops
    from pipeline.rounds.until import parse_until

    sent: list[dict] = []

    class Answer:
        def raise_for_status(self) -> None:
            pass

        def json(self) -> dict:
            return {"round_id": "r-1"}

    monkeypatch.setattr(httpx, "post", lambda url, **kw: sent.append(kw["json"]) or Answer())
    started = datetime(2026, 12, 6, 13, 52, 50, 123456, tzinfo=timezone.utc)
    assert ops.start_round("http://api", "tok", candidates=["kto"], until=started) == "r-1"
    assert sent == [{"candidates": ["kto"], "until": "2026-12-06T13:52:50.123+00:00"}]
    assert parse_until(sent[0]["until"]) == started.replace(microsecond=123000)


def test_oracle_reward_is_the_users_check() -> None:
    cases = [
        ("13", "13"),
        ("13, because 9 + 4 = 13", "13"),
        ("9 + 4 = 13", "13"),
        ("1,300", "1300"),
        ("no idea", "4"),
        ("4", "four"),
    ]
    for answer, reference in cases:
        assert first_number_answer([], answer, {"reference_answer": reference}) == float(is_correct(answer, reference))
    assert is_correct("13, because", "13") and not is_correct("9 + 4 = 13", "13")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rates = live_rates(
        pa.table({"trace_id": ["a", "b"], "adapter_version": [None, "1"], "reward": [-1.0, 1.0]}), [["a"], ["b"]]
    )
    plot_live_rates(rates, tmp_path / "live.png")
    assert (tmp_path / "live.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name", ["demo.toml", "hourglass.toml", "production.toml"])
def test_shipped_configs_learn_from_feedback_without_reference_answers(name: str) -> None:
    """The served model's candidates and gate use no reference answer, and no shipped config trains another
    served model (the demo's oracle is opt-in: below)."""
    from pipeline.config import load_config

    cfg = load_config(REPO / "deploy" / name)
    assert cfg.rl.gate.metric in ("feedback", "reward_model")
    served = [c for c in cfg.candidates if c.served_model == cfg.serving.model_name]
    assert {c.algorithm for c in served} >= {"grpo", "kto"}
    assert all(t.fn not in ("exact_answer", "first_number_answer") for c in served for t in c.reward)
    assert any(t.fn == "reward_model" for c in served for t in c.reward)
    assert [c for c in cfg.candidates if c.served_model != cfg.serving.model_name] == []


def test_the_demos_opt_in_oracle_block_loads_as_its_own_served_model(tmp_path: Path) -> None:
    """deploy/demo.toml carries the oracle commented out; uncommented, it is one more candidate on the users'
    own check, served as ORACLE_MODEL (never competing for `hourglass`), and the config still loads."""
    from pipeline.config import load_config
    from pipeline.demo.main import ORACLE_MODEL

    text = (REPO / "deploy" / "demo.toml").read_text()
    start = text.index('# [[candidates]]\n# name = "oracle"')
    block = text[start : text.index("\n\n", start)]
    on = text.replace(block, "\n".join(line.removeprefix("# ") for line in block.splitlines()))
    (tmp_path / "demo.toml").write_text(on)
    cfg = load_config(tmp_path / "demo.toml")
    off = load_config(REPO / "deploy" / "demo.toml")
    assert [c.name for c in cfg.candidates] == [c.name for c in off.candidates] + ["oracle"]
    oracle = cfg.candidates[-1]
    assert oracle.served_model == ORACLE_MODEL and [t.fn for t in oracle.reward] == ["first_number_answer"]


def test_round_printout_survives_nulls_from_the_api() -> None:
    """The ops API sends NaN as null (a gate without usable rows, a reward model without AUC)."""
    from pipeline.demo.main import _num, _print_round

    record = {
        "state": "no_winner",
        "metrics": {"reward_model/auc": None},
        "decisions": {
            "hourglass": {
                "winner": None,
                "reason": "keep base: none of the 3 held-out rows ...",
                "metric": "feedback",
                "champion_reward": None,
                "candidate_rewards": {"kto": None},
                "lower_bounds": {"kto": None},
            }
        },
    }
    _print_round(record, 96, {"trace_rows": 96})
    assert _num(None) == "-" and _num(float("nan")) == "-" and _num(0.5, "+.3f") == "+0.500"


def test_demo_canary_settles_within_the_demos_traffic() -> None:
    """deploy/demo.toml's canary decides on the demo's traffic: a challenger the users clearly prefer
    (45 % vs 15 % thumbs-up) is promoted before 60 events per side; an equally good one before 200 per
    side (the margin); a clearly worse one (10 % vs 45 %) is aborted before 60 per side."""
    from pipeline.canary.sequential import ArmStats, decide
    from pipeline.config import load_config

    canary = load_config(REPO / "deploy" / "demo.toml").serving.canary
    assert canary.enabled and canary.max_duration_s <= 600 and canary.check_interval_s <= 10

    def first_decision(p_challenger: float, p_champion: float, limit: int) -> tuple[str, int]:
        for n in range(1, limit + 1):  # exact shares at every look (no noise): when the rule can first decide
            arms = [
                ArmStats.of_rewards([1.0] * round(p * n) + [-1.0] * (n - round(p * n)), binary=True)
                for p in (p_challenger, p_champion)
            ]
            verdict = decide(
                *arms, alpha=canary.alpha, margin=canary.margin, min_feedback=canary.min_feedback, tau=canary.mixture_sd
            )
            if verdict.decision != "continue":
                return verdict.decision, n
        return "continue", limit

    assert first_decision(0.45, 0.15, 60)[0] == "promote"
    assert first_decision(0.40, 0.40, 200)[0] == "promote"
    assert first_decision(0.10, 0.45, 60)[0] == "abort"


def test_canary_printout_shows_fraction_counts_rates_decision_and_time(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.demo.main import _print_canary, _sides
    from pipeline.demo.traffic import Exchange

    view = {
        "version": "2",
        "decision": "promote",
        "reason": "challenger not worse by more than 0.15",
        "elapsed_s": 41.6,
        "lower": -0.12,
        "upper": 0.55,
        "challenger": {"n": 40, "mean": 0.45, "var": 0.25},
        "champion": {"n": 38, "mean": 0.24, "var": 0.2},
    }
    assert _sides(view) == "challenger 40 feedback events, 45% thumbs-up vs champion 38 feedback events, 24% thumbs-up"
    implicit = {**view, "metric": "mean_reward", "challenger": {"n": 80, "mean": -0.263}}  # behaviour counts too
    assert _sides(implicit) == (
        "challenger 80 feedback events, mean reward -0.26 vs champion 38 feedback events, mean reward +0.24"
    )
    sent = [Exchange(str(i), "q", "a", "1", True) for i in range(80)]
    line = _print_canary("2", view, sent, 63.2)
    assert (
        line.startswith("v2 PROMOTED after 42 s of canary traffic (63 s after the round, 80 requests)")
        and "[-0.12, +0.55]" in line
    )
    assert "undecided" not in line and "not worse by more than 0.15" in capsys.readouterr().out
    assert "no decision" in _print_canary("3", None, sent, 300.0)


def test_a_first_canary_is_shown_against_the_base_and_the_oracle_is_promoted_by_hand_with_a_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no champion the other side of the canary is the base (the scoreboard's "base" rows); the
    oracle's canary, which no user traffic could decide, is promoted through the ops API with a reason."""
    import httpx

    from pipeline.demo import main as demo

    view = {"control": "base", "challenger": {"n": 20, "mean": 0.1}, "champion": {"n": 18, "mean": 0.5}}
    assert demo._sides(view) == "challenger 20 feedback events, 10% thumbs-up vs base 18 feedback events, 50% thumbs-up"
    rates = live_rates(
        pa.table({"trace_id": ["a", "b"], "adapter_version": [None, "1"], "reward": [1.0, -1.0]}), [["a", "b"]]
    )
    assert rates[0].served_by == {"base": (1, 1), "1": (0, 1)}

    posted: list[tuple[str, dict]] = []

    class Answer:
        def raise_for_status(self) -> None:
            pass

    from pipeline.demo import ops

    monkeypatch.setattr(
        ops, "get", lambda url, **_: {demo.ORACLE_MODEL: {"canary": {"version": "1", "control": "base"}}}
    )
    monkeypatch.setattr(httpx, "post", lambda url, **kw: posted.append((url, kw)) or Answer())
    demo._promote_oracle("http://api", "tok")
    [(url, kw)] = posted
    assert url == f"http://api/canary/{demo.ORACLE_MODEL}/promote" and kw["params"] == {"reason": demo.ORACLE_REASON}
    assert kw["headers"] == {"authorization": "Bearer tok"}
    monkeypatch.setattr(ops, "get", lambda url, **_: {demo.ORACLE_MODEL: {"canary": None}})
    demo._promote_oracle("http://api", "tok")
    assert len(posted) == 1  # nothing on canary: nothing to promote


def _chat_answer(model: str, content: str, trace_id: str) -> JSONResponse:
    """A gateway's chat completion answer with its trace id and feedback token headers."""
    from pipeline.demo.traffic import FEEDBACK_HEADER

    return JSONResponse(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
        },
        headers={"x-hourglass-trace-id": trace_id, FEEDBACK_HEADER: "tok"},
    )


def test_simulated_users_wait_for_a_model_server_that_is_away() -> None:
    """The gateway answers 502 while vLLM restarts: each user asks again until it answers, then votes
    once; a server that stays away past the patience raises instead of hanging the demo."""
    from pipeline.demo.traffic import drive
    from tests.http_helpers import serve

    calls = {"chat": 0, "votes": []}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        calls["chat"] += 1
        if calls["chat"] <= 4:  # more than the openai client's own 2 retries
            return JSONResponse(
                {"error": {"message": "the model server is unreachable", "type": "upstream"}}, status_code=502
            )
        body = await request.json()
        content = "7" if "3 + 4" in body["messages"][0]["content"] else "0"
        return _chat_answer(body["model"], content, f"t{calls['chat']}")

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> dict:
        calls["votes"].append(await request.json())
        return {"ok": True}

    with serve(app, "fake gateway") as url:
        out = drive(url, "hourglass", 1, seed=3, concurrency=1, patience_s=60)
        assert calls["chat"] == 5 and len(out) == 1 and out[0].trace_id == "t5"
        assert [v["trace_id"] for v in calls["votes"]] == ["t5"]
        calls["chat"] = -1000  # away for good
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError):
            drive(url, "hourglass", 1, seed=3, concurrency=1, patience_s=1)
        assert time.monotonic() - started < 30


def test_simulated_users_wait_out_the_keys_rate_limit_instead_of_ending_the_demo() -> None:
    """On a fast host the demo's users sent faster than their key's rate limit allows: the first 429 on a vote
    ended the whole run (HTTPStatusError). A polite client waits the Retry-After and sends it again, once."""
    from pipeline.demo.traffic import drive
    from tests.http_helpers import serve

    calls = {"chat": 0, "feedback": 0, "votes": []}
    app = FastAPI()
    limited = {"error": {"message": "rate limit", "type": "rate_limit"}}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        calls["chat"] += 1
        if calls["chat"] <= 3:  # more than the openai client's own 2 retries
            return JSONResponse(limited, status_code=429, headers={"retry-after": "1"})
        body = await request.json()
        return _chat_answer(body["model"], "7", f"t{calls['chat']}")

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> JSONResponse:
        calls["feedback"] += 1
        if calls["feedback"] <= 2:
            return JSONResponse(limited, status_code=429, headers={"retry-after": "1"})
        calls["votes"].append(await request.json())
        return JSONResponse({"ok": True})

    with serve(app, "fake gateway") as url:
        out = drive(url, "hourglass", 1, seed=3, concurrency=1, patience_s=60)
    assert calls["chat"] == 4 and len(out) == 1 and out[0].trace_id == "t4"  # answered once, not asked again
    assert calls["feedback"] == 3 and [v["trace_id"] for v in calls["votes"]] == ["t4"]


def test_editing_users_correct_wrong_answers_and_the_others_only_vote() -> None:
    """Every user votes by the users' check; a user of EDITING_USERS also sends the right answer as the
    feedback's correction when the answer was wrong (never on a right answer, never from the other users)."""
    from pipeline.demo.traffic import EDITING_USERS, SIMULATED_USERS, drive
    from tests.http_helpers import serve

    votes: list[dict] = []
    users: dict[str, str] = {}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        trace = f"t{len(users)}"
        users[trace] = body["user"]
        return _chat_answer(body["model"], "99", trace)  # wrong for every one-digit addition (at most 18)

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> dict:
        votes.append(await request.json())
        return {"ok": True}

    with serve(app, "fake gateway") as url:
        out = drive(url, "hourglass", SIMULATED_USERS, seed=5, concurrency=1, patience_s=30)
    assert len(votes) == SIMULATED_USERS and all(v["thumbs"] == "down" for v in votes)
    by_trace = {e.trace_id: e for e in out}
    for vote in votes:
        user = users[vote["trace_id"]]
        if user in EDITING_USERS:
            assert vote["correction"] == by_trace[vote["trace_id"]].reference, user
        else:
            assert "correction" not in vote, user
    assert 0 < sum("correction" in v for v in votes) < len(votes)


def test_the_scoreboard_reports_forgetting_on_the_shipped_suite() -> None:
    """The demo's suite is the shipped one; base and champion scored by its check; forgetting = base - champion."""
    from pipeline.config import load_config
    from pipeline.demo.board import forgetting_line, suite_score
    from pipeline.demo.main import _suite_of
    from trainer.evaluation.regression import load_suite, suite_check

    suite = _suite_of(load_config(REPO / "deploy" / "demo.toml"))
    assert suite.path == "shipped:reasoning-gym-mix" and suite.check == "short_answer"
    prompts, check = load_suite(suite), suite_check(suite)
    right = {p.prompt_id: p.metadata["reference_answer"] for p in prompts}
    base = suite_score("base", prompts, lambda p: f"{right[p.prompt_id]}\nbecause ...", check)
    half = {p.prompt_id for p in prompts[::2]}
    champion = suite_score(
        "hourglass-v3", prompts, lambda p: right[p.prompt_id] if p.prompt_id in half else "I do not know", check
    )
    assert (base.score, base.prompts, champion.score) == (1.0, 64, 0.5)
    assert forgetting_line("reasoning", base, champion) == (
        "regression suite reasoning: base 1.000, final champion (hourglass-v3) 0.500 on 64 prompts; "
        "forgetting (base - champion) +0.500, OVER the target <= 0.05"
    )
    assert "+0.000, within the target" in forgetting_line("reasoning", champion, champion)
    assert "no champion was promoted" in forgetting_line("reasoning", base, None)


def test_after_a_promotion_the_demo_waits_for_the_promoted_version_to_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A canary promoted v3 while /status still said v2 (the route moves on the service's next reconcile): the
    round's accuracy and next phase went to v2 (seed 1 at 5 %, 2026-12-07). The demo now asks this wait for v3."""
    from pipeline.demo import main as demo_main

    answers = iter(["2", "2", "3", "3"])
    calls: list[str] = []

    def status(url: str) -> dict:
        calls.append(url)
        return {"serving": {"hourglass": {"serving": next(answers)}}}

    monkeypatch.setattr(demo_main, "get", status)
    monkeypatch.setattr(demo_main.time, "sleep", lambda s: None)
    assert demo_main._wait_serving("http://api", "hourglass", "3")["serving"] == "3"
    assert len(calls) == 3
    assert demo_main._wait_serving("http://api", "hourglass", None)["serving"] == "3"  # nothing to wait for
    assert len(calls) == 4
