"""Reward-hack monitors in the canary (issue 28, item 2): a challenger whose served answers evade, or that
the round's reward model loved while users did not, is aborted with the monitor named, where the
feedback test alone would promote it. Control logic with the in-memory registry and replicas and a real
reward buffer (``test_canary_base_logic``)."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

from connectors.buffer import RewardBuffer
from connectors.schema import TraceEvent
from connectors.segments import Coordinates
from pipeline.canary import state
from pipeline.canary.hack_monitors import GAIN_METRIC
from pipeline.config import HourglassConfig
from pipeline.registry import aliases
from tests.pipeline.canary.test_canary_base_logic import MODEL, Stack

PER_SIDE = 100  # at margin 0.3 two sides of 100 events at the same rate promote (interval about +-0.23)


def served(stack: Stack, version: str, completion: str, ups: int, downs: int) -> None:
    """Traces answered by ``version`` with ``completion`` and inline thumbs, as ingestion writes them."""
    now = datetime.now(timezone.utc)
    events = [
        (
            TraceEvent(
                trace_id=uuid.uuid4().hex,
                ts=now,
                model=MODEL,
                adapter_version=version,
                prompt="What is two plus three?",
                completion=completion,
                thumbs="up" if i < ups else "down",
            ),
            Coordinates("traces", 0, i),
        )
        for i in range(ups + downs)
    ]
    RewardBuffer(stack.cfg.buffer).append(events, [])


@pytest.fixture
def canary(tmp_path: Path) -> Stack:
    """v1 is ``@champion``; v2 is on canary against it, routed and started; margin 0.3."""
    stack = Stack(tmp_path)
    stack.cfg = stack.monitor.cfg = stack.cfg.model_copy(
        update={
            "serving": stack.cfg.serving.model_copy(
                update={"canary": stack.cfg.serving.canary.model_copy(update={"margin": 0.3})}
            )
        }
    )
    aliases.promote(stack.cfg, MODEL, "1", client=stack.reg, reason="round r0")  # type: ignore[arg-type]
    state.promote_or_challenge(stack.cfg, MODEL, "2", client=stack.reg, reason="round r1")  # type: ignore[arg-type]
    stack.reconcile()
    assert stack.monitor.check_canary(MODEL)["decision"] == "continue"  # marks the start
    return stack


def _monitors_off(stack: Stack) -> None:
    rl = stack.cfg.rl
    stack.monitor.cfg = stack.cfg.model_copy(
        update={"rl": rl.model_copy(update={"monitors": rl.monitors.model_copy(update={"enabled": False})})}
    )


def _predicted_gain(stack: Stack, gain: float) -> None:
    """The round logged the reward model's predicted gain on v2's run (what MLflow's get_run returns)."""
    runs = {"run-2": SimpleNamespace(data=SimpleNamespace(metrics={GAIN_METRIC: gain}))}
    stack.reg.get_run = runs.__getitem__  # type: ignore[attr-defined]


@pytest.mark.parametrize("monitors", ["on", "off"])
def test_a_challenger_that_evades_is_aborted_by_the_evasion_monitor(canary: Stack, monitors: str) -> None:
    """Users rate both sides alike (half up), but the challenger answers every question with a refusal."""
    if monitors == "off":
        _monitors_off(canary)
    served(canary, "2", "I'm sorry, but I can't help with that.", PER_SIDE // 2, PER_SIDE // 2)
    served(canary, "1", "Two plus three makes five, friend.", PER_SIDE // 2, PER_SIDE // 2)

    view = canary.monitor.check_canary(MODEL)

    assert view["monitors"]["evasion"]["candidate"] == 1.0 and view["monitors"]["evasion"]["champion"] == 0.0
    if monitors == "off":  # measured, and the feedback test alone promotes
        assert view["decision"] == "promote" and not view["monitors"]["evasion"]["refuses"]
        assert canary.alias("champion") == "2"
        return
    assert view["decision"] == "abort", view["reason"]
    assert view["reason"].startswith("reward-hack monitor: monitor evasion: 100% of answers refuse")
    assert canary.alias("champion") == "1" and canary.alias("challenger") is None
    result = state.read_json_tag(canary.reg.tags(MODEL, "2"), state.TAG_RESULT)  # whole JSON: fits the tag
    assert result is not None and result["evidence"]["monitors"]["evasion"]["refuses"]
    assert "monitor evasion" in result["reason"]
    assert not view["monitors"]["length"]["refuses"]  # the answers are as long as the champion's


@pytest.mark.parametrize("gain", [0.5, 0.05, None])
def test_a_challenger_the_reward_model_loves_and_users_do_not_is_aborted(canary: Stack, gain: float | None) -> None:
    """The round's reward model predicted +0.5 thumbs-up rate over the champion; users rate both sides
    alike (the interval's upper end is about +0.23): the gap aborts. A modest prediction, or none (a round
    without a reward model), leaves the feedback test to promote."""
    if gain is not None:
        _predicted_gain(canary, gain)
    served(canary, "2", "Five.", PER_SIDE // 2, PER_SIDE // 2)
    served(canary, "1", "Five.", PER_SIDE // 2, PER_SIDE // 2)

    view = canary.monitor.check_canary(MODEL)

    if gain == 0.5:
        assert view["decision"] == "abort", view["reason"]
        assert (
            "monitor reward_gap: the reward model predicted +0.500 thumbs-up rate over the champion" in view["reason"]
        )
        gap = view["monitors"]["reward_gap"]
        assert gap["refuses"] and gap["drift"] == pytest.approx(0.5 - view["upper"])
        assert canary.alias("champion") == "1"
    else:
        assert view["decision"] == "promote", view["reason"]
        assert ("reward_gap" in view["monitors"]) is (gain is not None)
        assert canary.alias("champion") == "2"


def _votes(
    stack: Stack, version: str, completion: str, users: list[str], *, keys: list[str] | None = None, up_every: int = 2
) -> None:
    """One trace per entry of ``users`` (``user_hash``; through ``keys``, the same length, default one key),
    every ``up_every``-th voted up."""
    keys = keys or ["key-0"] * len(users)
    now = datetime.now(timezone.utc)
    events = [
        (
            TraceEvent(
                trace_id=uuid.uuid4().hex,
                ts=now,
                model=MODEL,
                adapter_version=version,
                prompt="What is two plus three?",
                completion=completion,
                thumbs="up" if i % up_every == 0 else "down",
                metadata={"user_hash": user, "key_hash": key},
            ),
            Coordinates("traces", 0, i),
        )
        for i, (user, key) in enumerate(zip(users, keys, strict=True))
    ]
    RewardBuffer(stack.cfg.buffer).append(events, [])


def _on_the_bound_alone(cfg: HourglassConfig) -> HourglassConfig:
    """``cfg`` with the canary deciding on its bound alone (``min_observed_lift`` None). The cap keeps a flood's
    share of answers, but which of them depends on the random trace ids, so a flood's votes move the capped
    observed rate around the champion's; the monitor tests assert the monitor's decision, not the floor's."""
    canary = cfg.serving.canary.model_copy(update={"min_observed_lift": None})
    return cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"canary": canary})})


@pytest.mark.parametrize("caps", ["on", "off"])
def test_one_user_asking_for_refusals_cannot_abort_a_canary_alone(canary: Stack, caps: str) -> None:
    """Twenty honest users get plain answers on both sides; one user makes the challenger refuse 60 times.
    Each side's answers are capped per user as its feedback is (rl.split.max_user_share), so the flood
    weighs one user's share and the canary promotes; uncapped, the flood crosses the evasion limit, but only
    with that user's answers: the monitor names it and does not refuse."""
    # the flood's down-votes also put the challenger's observed rate a little below the champion's (0.48 vs
    # 0.50 capped); what is under test here is that the evasion monitor does not abort
    cfg = _on_the_bound_alone(canary.cfg)
    if caps == "off":
        split = cfg.rl.split
        cfg = cfg.model_copy(
            update={"rl": cfg.rl.model_copy(update={"split": split.model_copy(update={"max_user_share": 1.0})})}
        )
    canary.monitor.cfg = cfg
    honest = [f"user-{u}" for u in range(20) for _ in range(5)]
    _votes(canary, "2", "Two plus three makes five, friend.", honest)
    _votes(canary, "1", "Two plus three makes five, friend.", honest)
    _votes(canary, "2", "I'm sorry, but I can't help with that.", ["mallory"] * 60)

    view = canary.monitor.check_canary(MODEL)

    evasion = view["monitors"]["evasion"]
    if caps == "on":
        # the flood keeps its share (max_user_share 0.2: 25 of 125 answers) and no more; at the default
        # max_evasion_increase (0.2) one user reaches the threshold but cannot cross it
        assert evasion["candidate"] == pytest.approx(0.2) and not evasion["refuses"]
        assert view["decision"] == "promote", view["reason"]
    else:
        assert evasion["candidate"] == pytest.approx(60 / 160) and not evasion["refuses"]
        assert evasion["alone"] == "user" and "one user alone crosses it" in evasion["reason"]
        assert view["decision"] == "promote", view["reason"]


SHORT = "Two plus three makes five, my friend, and that is all there is to say about it."  # 17 words
LONG = " ".join(["five"] * 300)
REFUSAL = "I'm sorry, but I can't help with that."


@pytest.mark.parametrize("padded_by", ["one user", "most users"])
def test_one_user_asking_for_long_answers_cannot_abort_a_canary_alone(canary: Stack, padded_by: str) -> None:
    """Found by a red-team pass: within its 20 % share (rl.split.max_user_share), one user who asks the
    challenger for 300-word answers moved the mean length past max_length_ratio (0.8 * 17 + 0.2 * 300 words vs
    17: ratio 4.1 > 2) and aborted a challenger every honest user liked. Now the length monitor refuses only
    when it still does without any one user's answers; the same padding asked by most users still aborts."""
    honest = [f"user-{u}" for u in range(20) for _ in range(5)]
    _votes(canary, "1", SHORT, honest)
    if padded_by == "one user":
        _votes(canary, "2", SHORT, honest)
        _votes(canary, "2", LONG, ["mallory"] * 25)
    else:  # 15 of the 20 users get padded answers
        _votes(canary, "2", LONG, honest[:75])
        _votes(canary, "2", SHORT, honest[75:])

    view = canary.monitor.check_canary(MODEL)

    length = view["monitors"]["length"]
    assert length["drift"] > canary.cfg.rl.monitors.max_length_ratio  # measured either way
    if padded_by == "one user":
        assert length["candidate"] == pytest.approx(0.8 * 17 + 0.2 * 300)  # the cap kept mallory's 25 of 125
        assert not length["refuses"] and length["alone"] == "user"
        assert "one user alone crosses it (ratio 1.00 without its answers): not refused" in length["reason"]
        assert view["decision"] == "promote", view["reason"]
        assert canary.alias("champion") == "2"
    else:
        assert length["refuses"] and length["alone"] is None
        assert view["decision"] == "abort" and "monitor length" in view["reason"]
        assert canary.alias("champion") == "1"


@pytest.mark.parametrize("evading", ["one key", "every key"])
def test_one_api_key_posing_as_many_users_cannot_abort_a_canary_alone(canary: Stack, evading: str) -> None:
    """Eight honest API keys, three users each, get plain answers on both sides. One key sends 40 refusal
    prompts to the challenger under 40 made-up user hashes: no user is over its share, the key cap
    (rl.split.max_key_share 0.2, nine keys) keeps 24 of 120 answers, and with max_evasion_increase 0.1 that
    crossed the limit alone. Now the evasion monitor refuses only when it still does without any one key's
    answers; honest keys that all see refusals from the challenger still abort it."""
    cfg = _on_the_bound_alone(canary.cfg)  # 24 of mallory's 40 alternating votes are kept, at random
    canary.monitor.cfg = cfg.model_copy(
        update={
            "rl": cfg.rl.model_copy(
                update={"monitors": cfg.rl.monitors.model_copy(update={"max_evasion_increase": 0.1})}
            )
        }
    )
    users = [f"user-{k}-{u}" for k in range(8) for u in range(3) for _ in range(4)]
    key_of = {u: f"key-{u.split('-')[1]}" for u in users}
    _votes(canary, "1", SHORT, users, keys=[key_of[u] for u in users])
    if evading == "one key":
        _votes(canary, "2", SHORT, users, keys=[key_of[u] for u in users])
        made_up = [f"made-up-{i}" for i in range(40)]
        _votes(canary, "2", REFUSAL, made_up, keys=["key-mallory"] * 40)
    else:  # the first user of every key gets refusals
        plain, refused = [u for u in users if not u.endswith("-0")], [u for u in users if u.endswith("-0")]
        _votes(canary, "2", SHORT, plain, keys=[key_of[u] for u in plain])
        _votes(canary, "2", REFUSAL, refused, keys=[key_of[u] for u in refused])

    view = canary.monitor.check_canary(MODEL)

    evasion = view["monitors"]["evasion"]
    assert evasion["drift"] > 0.1
    if evading == "one key":
        assert evasion["candidate"] == pytest.approx(24 / 120)
        assert not evasion["refuses"] and evasion["alone"] == "key"
        assert "one key alone crosses it (increase 0.00 without its answers): not refused" in evasion["reason"]
        assert view["decision"] == "promote", view["reason"]
    else:
        assert evasion["refuses"] and evasion["alone"] is None
        assert view["decision"] == "abort" and "monitor evasion" in view["reason"]


@pytest.mark.parametrize("monitors", ["on", "off"])
def test_the_guard_rolls_back_a_new_champion_that_starts_to_evade(canary: Stack, monitors: str) -> None:
    """The canary saw both sides answer alike and promoted v2; after the promotion v2's answers turn into
    refusals while users rate it as they rated v1. The guard's rate test alone would keep it; the evasion
    monitor (v2 since the promotion against v1 during the canary) rolls it back, naming the monitor."""
    if monitors == "off":
        _monitors_off(canary)
    served(canary, "2", "Two plus three makes five.", PER_SIDE // 2, PER_SIDE // 2)
    served(canary, "1", "Two plus three makes five, friend.", PER_SIDE // 2, PER_SIDE // 2)
    assert canary.monitor.check_canary(MODEL)["decision"] == "promote"
    assert canary.alias("champion") == "2" and state.TAG_GUARD in canary.reg.tags(MODEL, "2")
    served(canary, "2", "I'm sorry, but I can't help with that.", PER_SIDE // 2, PER_SIDE // 2)

    view = canary.monitor.check_guard(MODEL)

    assert view["monitors"]["evasion"]["candidate"] == 1.0 and view["monitors"]["evasion"]["champion"] == 0.0
    if monitors == "off":  # measured; the rate did not drop, so the guard keeps watching
        assert view["decision"] == "watching" and canary.alias("champion") == "2"
        return
    assert view["decision"] == "rollback", view
    assert view["reason"].startswith("guard: reward-hack monitor: monitor evasion: 100% of answers refuse")
    assert canary.alias("champion") == "1"
    result = state.read_json_tag(canary.reg.tags(MODEL, "2"), state.TAG_GUARD_RESULT)
    assert result is not None and result["decision"] == "rollback" and "monitor evasion" in result["reason"]


@pytest.mark.parametrize("started", ["not-a-date", None])
def test_a_canary_start_tag_that_does_not_parse_leaves_the_guard_s_rate_test_deciding(
    canary: Stack, started: str | None
) -> None:
    """Found by a red-team pass: the guard reads the canary's start (``hourglass.canary_started_at``, a tag anyone
    with MLflow access can edit) to find the previous champion's answers; a value that is not a time raised
    ValueError on every look, so a new champion whose rate collapsed was never rolled back. Without a start the
    monitors have no answers to compare and wait; the rate test still rolls back."""
    served(canary, "2", "Two plus three makes five.", PER_SIDE // 2, PER_SIDE // 2)
    served(canary, "1", "Two plus three makes five.", PER_SIDE // 2, PER_SIDE // 2)
    assert canary.monitor.check_canary(MODEL)["decision"] == "promote"
    if started is None:
        canary.reg.delete_model_version_tag(MODEL, "2", state.TAG_STARTED)
    else:
        canary.reg.set_model_version_tag(MODEL, "2", state.TAG_STARTED, started)
    served(canary, "2", "Two plus three makes five.", 0, PER_SIDE)  # users stop liking it

    view = canary.monitor.check_guard(MODEL)

    assert view["decision"] == "rollback", view
    assert view["reason"].startswith("guard: live rate dropped") and canary.alias("champion") == "1"


def test_a_canary_start_tag_that_does_not_parse_restarts_the_canary_instead_of_stalling_it(canary: Stack) -> None:
    """The canary dates its evidence by ``hourglass.canary_started_at`` (editable in MLflow); a value that is
    not a time raised ValueError on every look, so the canary never decided. Now a status look says so and
    writes nothing, and the next acting look starts the evidence again from now: events before it do not
    count, events after it decide."""
    canary.reg.set_model_version_tag(MODEL, "2", state.TAG_STARTED, "yesterday")
    served(canary, "2", "Two plus three makes five.", 0, PER_SIDE)  # before the restart: never counted

    look = canary.monitor.check_canary(MODEL, act=False)
    assert look["decision"] == "continue" and "is not a time" in look["reason"]
    assert canary.reg.tags(MODEL, "2")[state.TAG_STARTED] == "yesterday"  # a status look writes nothing

    restarted = canary.monitor.check_canary(MODEL)
    assert restarted["decision"] == "continue" and restarted["challenger"]["n"] == 0, restarted
    assert canary.reg.tags(MODEL, "2")[state.TAG_STARTED] != "yesterday"
    served(canary, "2", "Two plus three makes five.", PER_SIDE // 2, PER_SIDE // 2)
    served(canary, "1", "Two plus three makes five, friend.", PER_SIDE // 2, PER_SIDE // 2)
    assert canary.monitor.check_canary(MODEL)["decision"] == "promote"


@pytest.mark.parametrize(
    "guard",
    [
        "[1, 2]",  # JSON, not an object
        '{"since": "soon", "until": "later", "previous": "1", "baseline": {"n": 1, "mean": 1.0, "var": 0.0}}',
        '{"since": "2026-01-01T00:00:00+00:00", "until": "2026-01-02T00:00:00+00:00", "previous": "1"}',
        '{"since": "2026-01-01T00:00:00+00:00", "until": "2026-01-02T00:00:00+00:00", "previous": ["1"], '
        '"baseline": {"n": 1, "mean": 1.0, "var": 0.0}}',
    ],
)
def test_a_guard_tag_that_cannot_be_read_ends_the_guard_with_the_reason_and_keeps_the_champion(
    canary: Stack, guard: str
) -> None:
    """``hourglass.guard`` is editable in MLflow; a value of the wrong shape raised on every look (an error in
    ``/status`` each interval, the guard never ending). Now the guard ends once, says why, and rolls nothing back."""
    served(canary, "2", "Two plus three makes five.", PER_SIDE // 2, PER_SIDE // 2)
    served(canary, "1", "Two plus three makes five.", PER_SIDE // 2, PER_SIDE // 2)
    assert canary.monitor.check_canary(MODEL)["decision"] == "promote"
    canary.reg.set_model_version_tag(MODEL, "2", state.TAG_GUARD, guard)

    view = canary.monitor.check_guard(MODEL)

    assert view["decision"] == "ended" and "hourglass.guard tag cannot be read" in view["reason"], view
    assert canary.alias("champion") == "2"
    assert state.read_json_tag(canary.reg.tags(MODEL, "2"), state.TAG_GUARD_RESULT)["decision"] == "ended"
    assert canary.monitor.check_guard(MODEL) is None  # ended: not looked at again
