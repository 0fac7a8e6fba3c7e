"""Implicit feedback from linked turns (connectors/implicit.py) and its place in a snapshot's reward."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from connectors.buffer import RewardBuffer
from connectors.config import BufferConfig, ImplicitConfig, RewardSpec
from connectors.implicit import Turn, derive, reports_error, similarity
from connectors.reward import with_implicit
from connectors.schema import FeedbackEvent, TraceEvent
from connectors.segments import Coordinates

T0 = datetime(2026, 3, 1, 10, 0, tzinfo=timezone.utc)
CFG = ImplicitConfig(window_s=600)
LATER = T0 + timedelta(hours=2)  # every window of a T0 trace has closed


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str = "", calls: list | None = None) -> dict:
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def turn(tid: str, minutes: float, messages: list, *, parent: str | None = None, calls: list | None = None) -> Turn:
    return Turn(
        trace_id=tid,
        ts=T0 + timedelta(minutes=minutes),
        prompt=json.dumps(messages),
        conversation_id="conv-a",
        turn=sum(1 for m in messages if m["role"] == "assistant"),
        parent_trace_id=parent,
        completion_tool_calls=json.dumps(calls) if calls else None,
    )


CALL = [{"id": "call-1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "2+2"}'}}]
Q1 = [user("What is the capital of France?")]


def signals(turns: list[Turn], now: datetime = LATER, cfg: ImplicitConfig = CFG) -> dict[str, dict]:
    return {t.trace_id: d for t, d in zip(turns, derive(turns, now, cfg), strict=True)}


def test_going_on_is_continued_restating_is_rephrased_and_provenance_names_the_evidence() -> None:
    went_on = [turn("t1", 0, Q1), turn("t2", 2, [*Q1, assistant("Paris."), user("And of Italy?")], parent="t1")]
    got = signals(went_on)
    assert got["t1"] == {"continued": {"by": "t2", "after_s": 120.0, "window_s": 600}}
    restated = [
        turn("t1", 0, Q1),
        turn("t2", 1, [*Q1, assistant("Lyon."), user("what is the capital of france")], parent="t1"),
    ]
    assert list(signals(restated)["t1"]) == ["rephrased"]
    late = [turn("t1", 0, Q1), turn("t2", 11, [*Q1, assistant("Paris."), user("And of Italy?")], parent="t1")]
    assert list(signals(late)["t1"]) == ["abandoned"]  # the next turn came after the window


def test_the_same_prompt_again_is_regenerated_and_nothing_after_a_closed_window_is_abandoned() -> None:
    again = [turn("t1", 0, Q1), turn("t2", 0.5, Q1)]
    got = signals(again)
    assert got["t1"] == {"regenerated": {"by": "t2", "after_s": 30.0, "window_s": 600}}
    assert got["t2"] == {"abandoned": {"by": None, "after_s": None, "window_s": 600}}
    other_conversation = [turn("t1", 0, Q1), Turn(**{**turn("t2", 0.5, Q1).__dict__, "conversation_id": "conv-b"})]
    assert "regenerated" not in signals(other_conversation)["t1"]  # another identity's chat: not this user's move


def test_an_undecided_window_is_absent_not_negative() -> None:
    young = [turn("t1", 0, Q1)]
    assert signals(young, now=T0 + timedelta(minutes=5)) == {"t1": {}}
    assert signals(young, now=T0 + timedelta(minutes=10)) == {
        "t1": {"abandoned": {"by": None, "after_s": None, "window_s": 600}}
    }
    # evidence inside an open window decides at once
    went_on = [turn("t1", 0, Q1), turn("t2", 1, [*Q1, assistant("Paris."), user("Thanks! Next: Spain?")], parent="t1")]
    assert list(signals(went_on, now=T0 + timedelta(minutes=2))["t1"]) == ["continued"]


def test_a_tool_result_reporting_an_error_is_tool_error_and_the_apps_tool_turn_is_not_a_user_move() -> None:
    calls = [turn("t1", 0, Q1, calls=CALL)]
    failed = {"role": "tool", "tool_call_id": "call-1", "content": '{"error": "division by zero"}'}
    fine = {"role": "tool", "tool_call_id": "call-1", "content": '{"result": 4}'}
    bad = calls + [turn("t2", 0.1, [*Q1, assistant(calls=CALL), failed], parent="t1")]
    assert list(signals(bad, now=T0 + timedelta(minutes=5))["t1"]) == ["tool_error"]
    assert list(signals(bad)["t1"]) == ["tool_error", "abandoned"]  # and the user left after t2's answer
    good = calls + [turn("t2", 0.1, [*Q1, assistant(calls=CALL), fine], parent="t1")]
    # the app answered the call: neither continued nor abandoned by itself (and t2's window is still open)
    assert signals(good, now=T0 + timedelta(minutes=5))["t1"] == {}
    other = {"role": "tool", "tool_call_id": "call-9", "content": "Error: no such call"}
    unrelated = calls + [turn("t2", 0.1, [*Q1, assistant(calls=CALL), other], parent="t1")]
    assert signals(unrelated)["t1"] == {}  # an error for a call this answer did not make


CALL_2 = [{"id": "call-2", "type": "function", "function": {"name": "calc", "arguments": '{"x": "4*3"}'}}]


def tool_chain(then: list[Turn]) -> list[Turn]:
    """t1 calls a tool, t2 (its result) calls another, t3 (that result) answers the user; ``then`` follows t3."""
    r1 = {"role": "tool", "tool_call_id": "call-1", "content": "4"}
    r2 = {"role": "tool", "tool_call_id": "call-2", "content": "12"}
    return [
        turn("t1", 0, Q1, calls=CALL),
        turn("t2", 0.1, [*Q1, assistant(calls=CALL), r1], parent="t1", calls=CALL_2),
        turn("t3", 0.2, [*Q1, assistant(calls=CALL), r1, assistant(calls=CALL_2), r2], parent="t2"),
        *then,
    ]


T3_PROMPT = [*Q1, assistant(calls=CALL), {"role": "tool", "tool_call_id": "call-1", "content": "4"}]
T3_PROMPT += [assistant(calls=CALL_2), {"role": "tool", "tool_call_id": "call-2", "content": "12"}]


def test_tool_calling_turns_take_the_users_verdict_on_the_answer_their_results_led_to() -> None:
    went_on = tool_chain([turn("t4", 2.2, [*T3_PROMPT, assistant("12."), user("And of Italy?")], parent="t3")])
    got = signals(went_on)
    assert got["t3"] == {"continued": {"by": "t4", "after_s": 120.0, "window_s": 600}}
    assert got["t2"] == {"continued": {"by": "t4", "after_s": 126.0, "window_s": 600, "via": "t3"}}
    assert got["t1"] == {"continued": {"by": "t4", "after_s": 132.0, "window_s": 600, "via": "t3"}}
    restated = tool_chain(
        [turn("t4", 1, [*T3_PROMPT, assistant("7."), user("what is the capital of France")], parent="t3")]
    )
    assert [list(signals(restated)[t]) for t in ("t1", "t2", "t3")] == [["rephrased"]] * 3
    left = signals(tool_chain([]))
    assert [list(left[t]) for t in ("t1", "t2", "t3")] == [["abandoned"]] * 3
    # another answer asked for after the tool results says nothing about the calls: not passed back
    regenerated = signals(tool_chain([turn("t3b", 0.5, T3_PROMPT, parent="t2")]), now=T0 + timedelta(minutes=5))
    assert list(regenerated["t3"]) == ["regenerated"] and regenerated["t2"] == regenerated["t1"] == {}
    # undecided at the end of the chain: undecided all the way back
    assert signals(tool_chain([]), now=T0 + timedelta(minutes=5)) == {"t1": {}, "t2": {}, "t3": {}}


def test_only_a_turn_sending_back_this_answers_tool_results_passes_a_verdict_back() -> None:
    other = {"role": "tool", "tool_call_id": "call-9", "content": "4"}
    unrelated = [
        turn("t1", 0, Q1, calls=CALL),
        turn("t2", 0.1, [*Q1, assistant(calls=CALL), other], parent="t1"),
        turn("t3", 1, [*Q1, assistant(calls=CALL), other, assistant("4."), user("Next: 5*5?")], parent="t2"),
    ]
    got = signals(unrelated)
    assert list(got["t2"]) == ["continued"] and got["t1"] == {}  # t2 answered no call of t1's
    failed = {"role": "tool", "tool_call_id": "call-1", "content": "Error: no calculator"}
    errored = [
        turn("t1", 0, Q1, calls=CALL),
        turn("t2", 0.1, [*Q1, assistant(calls=CALL), failed], parent="t1"),
        turn("t3", 1, [*Q1, assistant(calls=CALL), failed, assistant("4."), user("Next: 5*5?")], parent="t2"),
    ]
    assert list(signals(errored)["t1"]) == ["tool_error", "continued"]  # its own error stays; the verdict joins it


def test_passing_a_verdict_back_holds_for_equal_timestamps_reused_call_ids_and_forged_loops() -> None:
    """Found by a hostile pass: a chain whose turns share one timestamp lost the verdict when the parent's id
    sorted first; an error in an earlier turn's result was blamed on a later call with a reused id; a forged loop
    of a tool turn and an answer handed the tool turn a verdict whose evidence was itself; a non-string
    ``tool_call_id`` raised TypeError."""
    r1 = {"role": "tool", "tool_call_id": "c1", "content": "4"}
    r2 = {"role": "tool", "tool_call_id": "call-2", "content": "5"}
    for first, second in (("a", "b"), ("b", "a")):
        chain = [
            turn(first, 0, Q1, calls=[{**CALL[0], "id": "c1"}]),
            turn(second, 0, [*Q1, assistant(calls=[{**CALL[0], "id": "c1"}]), r1], parent=first, calls=CALL_2),
            turn(
                "d",
                0,
                [*Q1, assistant(calls=[{**CALL[0], "id": "c1"}]), r1, assistant(calls=CALL_2), r2],
                parent=second,
            ),
            turn("e", 1, [user("next question about cats")], parent="d"),
        ]
        assert [list(signals(chain)[t]) for t in (first, second)] == [["continued"], ["continued"]], (first, second)
    old_error = {"role": "tool", "tool_call_id": "call-1", "content": "Error: boom"}
    reused = [
        turn("t0", 0, Q1, calls=CALL),
        turn("t1", 0.1, [*Q1, assistant(calls=CALL), old_error], parent="t0", calls=CALL),
        turn(
            "t2",
            0.2,
            [*Q1, assistant(calls=CALL), old_error, assistant(calls=CALL), user("forget it: dogs?")],
            parent="t1",
        ),
    ]
    got = signals(reused)
    assert list(got["t0"]) == ["tool_error"] and got["t1"] == {}  # the error was t0's call's, not t1's
    loop = [
        turn("t", 0, [*Q1, user("again")], calls=[{**CALL[0], "id": "c1"}], parent="c"),
        turn("c", 0, [*Q1, assistant(calls=[{**CALL[0], "id": "c1"}]), r1, user("ok thanks")], parent="t"),
    ]
    assert all(p["by"] != "t" for p in signals(loop)["t"].values())
    unhashable = {"role": "tool", "tool_call_id": ["call-1"], "content": "4"}
    odd = [turn("t1", 0, Q1, calls=CALL), turn("t2", 0.1, [*Q1, assistant(calls=CALL), unhashable], parent="t1")]
    assert signals(odd)["t1"] == {}


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ('{"error": "boom"}', True),
        ('{"is_error": true, "content": "x"}', True),
        ('{"error": null, "result": 1}', False),
        ("Error: timeout", True),
        ("Traceback (most recent call last):", True),
        ("errors are rare", False),
        ("42", False),
        ([{"type": "text", "text": "Exception raised"}], True),
        (None, False),
    ],
)
def test_tool_results_that_report_errors(content: object, error: bool) -> None:
    assert reports_error(content) is error


def test_similarity_is_word_set_jaccard_bounded_in_cost() -> None:
    assert similarity("What is 2+2?", "what is 2 + 2") == 1.0
    assert similarity("the cat", "a dog") == 0.0
    assert similarity("x " * 100_000, "x") == 1.0  # only the first characters are read


SPEC = RewardSpec()


@pytest.mark.parametrize(
    ("signals_", "derived", "expected"),
    [
        ({"thumbs": "down"}, {"continued": {}}, (-1.0, "thumbs")),  # explicit wins
        ({"rating": 5}, {"tool_error": {}}, (1.0, "rating")),
        ({}, {"continued": {}}, (0.5, "continued")),
        ({}, {"rephrased": {}}, (-0.5, "rephrased")),
        ({}, {"abandoned": {}}, (None, None)),  # weight 0: recorded, not a reward
        ({"edited": True}, {"continued": {}}, (0.0, "edited+continued")),
        ({"regenerated": True}, {"regenerated": {}}, (-0.5, "regenerated")),  # the client's flag, counted once
        ({}, {"tool_error": {}, "rephrased": {}}, (-1.0, "tool_error+rephrased")),  # clipped
    ],
)
def test_reward_with_implicit_signals(signals_: dict, derived: dict, expected: tuple) -> None:
    from connectors.reward import reward_from_signals

    reward, source = reward_from_signals(signals_, SPEC)
    assert with_implicit(reward, source, signals_, derived, SPEC, ImplicitConfig()) == expected


def _event(i: int, minutes: float, messages: list, **over: object) -> tuple[TraceEvent, Coordinates]:
    event = TraceEvent(
        trace_id=f"t{i}",
        ts=T0 + timedelta(minutes=minutes),
        model="m",
        prompt=messages,
        completion="",
        conversation_id="conv-a",
        turn=sum(1 for m in messages if m["role"] == "assistant"),
        metadata={},
        **over,
    )
    return event, Coordinates("traces", 0, i)


def test_a_snapshot_labels_unrated_turns_from_behaviour_and_explicit_feedback_wins(tmp_path: Path) -> None:
    buf = RewardBuffer(BufferConfig(root=str(tmp_path / "b"), dead_letter_root=str(tmp_path / "d")))
    italy = [*Q1, assistant("Paris."), user("And of Italy?")]
    traces = [
        _event(1, 0, Q1),  # continued by t2
        _event(2, 1, italy, parent_trace_id="t1"),  # rated down, and nothing followed
        _event(3, 2, [user("What is 7 * 6?")]),  # regenerated by t4
        _event(4, 3, [user("What is 7 * 6?")]),  # the last word: abandoned (weight 0)
    ]
    feedback = [(FeedbackEvent(trace_id="t2", ts=T0 + timedelta(minutes=1), thumbs="down"), Coordinates("f", 0, 9))]
    buf.append(traces, feedback)
    rows = {r["trace_id"]: r for r in buf.snapshot(now=LATER).to_pylist()}
    assert (rows["t1"]["reward"], rows["t1"]["reward_source"]) == (0.5, "continued")
    assert json.loads(rows["t1"]["implicit"]) == {"continued": {"after_s": 60.0, "by": "t2", "window_s": 600.0}}
    assert (rows["t2"]["reward"], rows["t2"]["reward_source"]) == (-1.0, "thumbs")  # explicit wins over abandoned
    assert (rows["t3"]["reward"], rows["t3"]["reward_source"]) == (-0.5, "regenerated")
    assert rows["t4"]["reward"] is None and list(json.loads(rows["t4"]["implicit"])) == ["abandoned"]
    # the evidence may lie after the snapshot's end: t1's window reaches past it
    only_first = buf.snapshot(end=T0 + timedelta(seconds=30), now=LATER).to_pylist()
    assert [(r["trace_id"], r["reward_source"]) for r in only_first] == [("t1", "continued")]
    # while its window is open, an unrated answer with no evidence yet has no reward at all
    young = {r["trace_id"]: r for r in buf.snapshot(now=T0 + timedelta(minutes=4)).to_pylist()}
    assert young["t4"]["reward"] is None and young["t4"]["implicit"] is None
    off = RewardBuffer(
        BufferConfig(root=str(tmp_path / "b"), dead_letter_root=str(tmp_path / "d"), implicit={"enabled": False})
    )
    assert {r["trace_id"]: r["reward"] for r in off.snapshot(now=LATER).to_pylist()} == {
        "t1": None,
        "t2": -1.0,
        "t3": None,
        "t4": None,
    }


def test_a_snapshot_as_of_a_past_time_sees_only_what_was_dated_before_it(tmp_path: Path) -> None:
    """A replay of a past window (``POST /rounds`` with ``until``) takes the snapshot a round then could have
    taken: no trace, feedback or implicit evidence from after it, and windows still open then are undecided."""
    buf = RewardBuffer(BufferConfig(root=str(tmp_path / "b"), dead_letter_root=str(tmp_path / "d")))
    italy = [*Q1, assistant("Paris."), user("And of Italy?")]
    buf.append(
        [
            _event(1, 0, Q1),  # continued by t2 at 1 min
            _event(2, 1, italy, parent_trace_id="t1"),
            _event(3, 2, [user("What is 7 * 6?")]),  # regenerated by t4 at 3 min: after the cut
            _event(4, 3, [user("What is 7 * 6?")]),
        ],
        [
            (FeedbackEvent(trace_id="t2", ts=T0 + timedelta(minutes=1), thumbs="down"), Coordinates("f", 0, 8)),
            (FeedbackEvent(trace_id="t1", ts=T0 + timedelta(minutes=4), thumbs="down"), Coordinates("f", 0, 9)),
        ],
    )
    cut = T0 + timedelta(minutes=2, seconds=30)
    rows = {r["trace_id"]: r for r in buf.snapshot(T0, cut, as_of=cut).to_pylist()}
    assert sorted(rows) == ["t1", "t2", "t3"]
    assert (rows["t1"]["reward"], rows["t1"]["reward_source"]) == (0.5, "continued")  # its down-vote came later
    assert (rows["t2"]["reward"], rows["t2"]["reward_source"]) == (-1.0, "thumbs")
    assert rows["t3"]["reward"] is None and rows["t3"]["implicit"] is None  # undecided then, not regenerated
    # an end past the cut is cut too: t4 did not exist yet
    assert sorted(r["trace_id"] for r in buf.snapshot(T0, LATER, as_of=cut).to_pylist()) == ["t1", "t2", "t3"]
    # the same window read now: the later evidence and vote are in
    now = {r["trace_id"]: r for r in buf.snapshot(T0, cut, now=LATER).to_pylist()}
    assert (now["t1"]["reward_source"], now["t3"]["reward_source"]) == ("thumbs", "regenerated")


def test_the_cut_is_exact_to_the_millisecond(tmp_path: Path) -> None:
    """``int(cut.timestamp() * 1000)`` lands 1 ms low for some times (this one): a trace 1 ms before the cut was
    left out, and feedback dated at the cut too."""
    cut = datetime(2004, 3, 15, 7, 55, 47, 472000, tzinfo=timezone.utc)
    assert int(cut.timestamp() * 1000) != (cut - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(milliseconds=1)
    buf = RewardBuffer(BufferConfig(root=str(tmp_path / "b"), dead_letter_root=str(tmp_path / "d")))
    before = cut - timedelta(milliseconds=1)
    trace = TraceEvent(trace_id="t1", ts=before, model="m", prompt=Q1, completion="", metadata={})
    vote = FeedbackEvent(trace_id="t1", ts=cut, thumbs="up")
    buf.append([(trace, Coordinates("traces", 0, 1))], [(vote, Coordinates("f", 0, 2))])
    rows = buf.snapshot(cut - timedelta(hours=1), cut, as_of=cut).to_pylist()
    assert [(r["trace_id"], r["reward_source"]) for r in rows] == [("t1", "thumbs")]
    assert buf.snapshot(cut - timedelta(hours=1), before, as_of=cut).num_rows == 0  # the end is exclusive
    with pytest.raises(ValueError, match="no time zone"):
        buf.snapshot(as_of=cut.replace(tzinfo=None))


def test_hostile_turns_cannot_break_or_stall_the_derivation() -> None:
    """A tool result nested past the JSON parser's limit reads as text; a self-linked trace is not its own
    evidence; another user's identical prompt is not a regeneration; a flood of resends stays fast."""
    deep = "[" * 5000 + "]" * 5000
    assert reports_error(deep) is False
    assert reports_error("Error: " + "x" * 200_000) is True
    calls = [turn("t1", 0, Q1, calls=CALL)]
    nested = {"role": "tool", "tool_call_id": "call-1", "content": deep}
    assert (
        "tool_error" not in signals(calls + [turn("t2", 0.1, [*Q1, assistant(calls=CALL), nested], parent="t1")])["t1"]
    )
    # tool turns linked in a loop (forged parents, one timestamp) pass nothing round and round
    result = {"role": "tool", "tool_call_id": "call-1", "content": "4"}
    loop = [turn(t, 0, [*Q1, assistant(calls=CALL), result], parent=p, calls=CALL) for t, p in (("a", "b"), ("b", "a"))]
    assert signals(loop) == {"a": {}, "b": {}}
    own = Turn(**{**turn("t1", 0, Q1).__dict__, "parent_trace_id": "t1"})
    assert list(signals([own])["t1"]) == ["abandoned"]
    alice = Turn(**{**turn("t1", 0, Q1).__dict__, "user": "alice"})
    mallory = Turn(**{**turn("t2", 1, Q1).__dict__, "user": "mallory"})
    assert "regenerated" not in signals([alice, mallory])["t1"]
    went_on = Turn(
        **{**turn("t3", 2, [*Q1, assistant("Paris."), user("And Italy?")], parent="t1").__dict__, "user": "mallory"}
    )
    assert "continued" not in signals([alice, went_on])["t1"]  # a continuation by another identity
    import time

    flood = [turn(f"r{i}", i / 600, Q1) for i in range(20_000)]
    started = time.perf_counter()
    got = derive(flood, LATER, CFG)
    assert time.perf_counter() - started < 20  # O(n log n): seconds, not the hour a quadratic scan takes
    assert got[0] == {"regenerated": {"by": "r1", "after_s": 0.1, "window_s": 600}}
    chain = [turn("c0", 0, Q1, calls=CALL)]  # 20,000 tool turns in one chain: the verdict travels back linearly
    for i in range(1, 20_000):
        chain.append(turn(f"c{i}", i / 2000, [*Q1, assistant(calls=CALL), result], parent=f"c{i - 1}", calls=CALL))
    chain[-1] = Turn(**{**chain[-1].__dict__, "completion_tool_calls": None})
    started = time.perf_counter()
    got = derive(chain, LATER, CFG)
    assert time.perf_counter() - started < 20
    assert got[0] == {"abandoned": {"by": None, "after_s": None, "window_s": 600, "via": "c19999"}}


def test_linking_a_flood_of_unlinked_turns_is_not_quadratic(tmp_path: Path) -> None:
    """5,000 answers under one hash and 5,000 unlinked continuations of it: each links to the latest answer
    not after it, in seconds (the scan of every answer per turn took minutes)."""
    import time

    import pyarrow as pa

    from connectors.buffer import _link_turns

    n = 5000
    metadata = [json.dumps({"conversation": {"answer": "h"}})] * n + [
        json.dumps({"conversation": {"continues": "h"}})
    ] * n
    times = [T0 + timedelta(seconds=i) for i in range(n)] + [T0 + timedelta(seconds=i + 0.5) for i in range(n)]
    table = pa.table(
        {
            "trace_id": [f"a{i}" for i in range(n)] + [f"c{i}" for i in range(n)],
            "ts": pa.array(times, pa.timestamp("ms", tz="UTC")),
            "parent_trace_id": pa.array([None] * (2 * n), pa.string()),
            "metadata": metadata,
        }
    )
    started = time.perf_counter()
    parents = _link_turns(table)["parent_trace_id"].to_pylist()
    assert time.perf_counter() - started < 10
    assert parents[n:] == [f"a{i}" for i in range(n)] and parents[:n] == [None] * n
