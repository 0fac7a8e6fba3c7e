"""One user, or one API key with many made-up users, cannot decide a canary or the guard (issue 28, item 3).

Each side's evidence is capped per key and per user (``rl.split.max_key_share`` / ``max_user_share``,
:func:`pipeline.canary.monitor.capped_side`). The flood: one user (or one key sending a new ``user`` on every
request) asks 60 questions and votes the same way on each. Without the cap it aborts a challenger that 15 honest
users liked, forces a promotion from the champion's side, and rolls a new champion back through the guard.
Control logic with the in-memory registry and replicas and a real reward buffer (``test_canary_base_logic``).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest

from connectors.buffer import RewardBuffer
from connectors.schema import TraceEvent
from connectors.segments import Coordinates
from pipeline.canary import state
from pipeline.canary.monitor import LiveReward, capped_side
from pipeline.registry import aliases
from tests.pipeline.canary.test_canary_base_logic import MODEL, Stack

FLOOD = 60


def feedback(stack: Stack, version: str | None, votes: list[tuple[str, str, bool]]) -> None:
    """Traces answered by ``version`` with inline thumbs: ``(key_hash, user_hash, thumbs up)`` each, as the
    gateway records them and ingestion writes them."""
    now = datetime.now(timezone.utc)
    events = [
        (
            TraceEvent(
                trace_id=uuid.uuid4().hex,
                ts=now,
                model=MODEL,
                adapter_version=version,
                prompt="hi",
                completion="ok",
                thumbs="up" if up else "down",
                metadata={"user_hash": user, "key_hash": key},
            ),
            Coordinates("traces", 0, i),
        )
        for i, (key, user, up) in enumerate(votes)
    ]
    RewardBuffer(stack.cfg.buffer).append(events, [])


def honest(prefix: str, users: int, per_user: int, ups: int, *, keys: int) -> list[tuple[str, str, bool]]:
    """``users`` honest users over ``keys`` API keys, ``per_user`` votes each; the first ``ups`` users vote up."""
    return [(f"key-{u % keys}", f"{prefix}-{u}", u < ups) for u in range(users) for _ in range(per_user)]


def flood(by: str, up: bool) -> list[tuple[str, str, bool]]:
    """60 votes: ``by="user"``: one user of the honest users' key; ``by="key"``: one key, a new user each time."""
    if by == "user":
        return [("key-0", "mallory", up)] * FLOOD
    return [("key-mallory", f"mallory-{i}", up) for i in range(FLOOD)]


@pytest.fixture
def canary(tmp_path: Path) -> Stack:
    """v1 is ``@champion``; v2 is on canary against it, routed and started."""
    stack = Stack(tmp_path)
    aliases.promote(stack.cfg, MODEL, "1", client=stack.reg, reason="round r0")  # type: ignore[arg-type]
    out = state.promote_or_challenge(stack.cfg, MODEL, "2", client=stack.reg, reason="round r1")  # type: ignore[arg-type]
    assert out["action"] == "challenger", out
    stack.reconcile()
    assert stack.monitor.check_canary(MODEL)["decision"] == "continue"  # marks the start
    return stack


def keys_for(by: str) -> int:
    return 1 if by == "user" else 5  # one key for everyone (a single-key deployment), or five honest keys


@pytest.mark.parametrize("by", ["user", "key"])
def test_a_flood_of_down_votes_cannot_abort_a_challenger_honest_users_liked(canary: Stack, by: str) -> None:
    feedback(canary, "2", honest("chall", 15, 2, 15, keys=keys_for(by)) + flood(by, up=False))
    feedback(canary, "1", honest("champ", 23, 1, 23, keys=keys_for(by)))

    view = canary.monitor.check_canary(MODEL)

    assert view["decision"] != "abort", view
    assert view["challenger"]["n"] < 30 + FLOOD // 4, "the flood weighs its share, not 60 observations"
    assert view["events_before_caps"] == {"challenger": 30 + FLOOD, "champion": 23}, "the view shows what was cut"
    assert view["challenger"]["mean"] > 0.7 and canary.alias("challenger") == "2"


@pytest.mark.parametrize("by", ["user", "key"])
def test_a_flood_of_down_votes_on_the_champion_cannot_force_a_promotion(canary: Stack, by: str) -> None:
    feedback(canary, "2", honest("chall", 30, 1, 18, keys=keys_for(by)))  # users like it less: 60 % vs 90 %
    feedback(canary, "1", honest("champ", 30, 1, 27, keys=keys_for(by)) + flood(by, up=False))

    view = canary.monitor.check_canary(MODEL)

    assert view["decision"] != "promote", view
    assert canary.alias("champion") == "1" and canary.alias("challenger") == "2"


@pytest.mark.parametrize("by", ["user", "key"])
def test_a_flood_cannot_make_the_guard_roll_a_new_champion_back(canary: Stack, by: str) -> None:
    baseline = {"n": 40, "mean": 0.8, "var": 0.16}  # the old champion's rate during the canary
    state.promote_challenger(canary.cfg, MODEL, client=canary.reg, evidence={"champion": baseline})  # type: ignore[arg-type]
    assert canary.alias("champion") == "2" and state.TAG_GUARD in canary.reg.tags(MODEL, "2")
    feedback(canary, "2", honest("user", 30, 1, 26, keys=keys_for(by)) + flood(by, up=False))

    view = canary.monitor.check_guard(MODEL)

    assert view["decision"] == "watching", view
    assert canary.alias("champion") == "2"


def test_honest_canaries_decide_on_all_their_events(canary: Stack) -> None:
    """Users and keys of similar weight are not cut: an honest canary's evidence is all of its events."""
    feedback(canary, "2", honest("chall", 18, 2, 3, keys=3))
    feedback(canary, "1", honest("champ", 18, 2, 16, keys=3))
    view = canary.monitor.check_canary(MODEL)
    assert view["decision"] == "abort" and (view["challenger"]["n"], view["champion"]["n"]) == (36, 36), view


def test_capped_side_cuts_the_flood_to_its_share_and_never_a_single_unit() -> None:
    side = [LiveReward(f"h{u}", 1.0, "thumbs", f"u{u}", "k") for u in range(15)]
    side += [LiveReward(f"m{i}", -1.0, "thumbs", "mallory", "k") for i in range(FLOOD)]
    kept = capped_side(side, max_user_share=0.2, max_key_share=0.2)
    assert sum(1 for r in kept if r.user == "mallory") == 3 and len(kept) == 18  # 3 <= 0.2 * 18
    alone = [LiveReward(f"a{i}", 1.0, "thumbs") for i in range(50)]  # no user or key hashes: one unit, not cut
    assert capped_side(alone, max_user_share=0.2, max_key_share=0.2) == alone


def test_a_key_alone_on_the_challenger_s_side_is_capped_when_the_canary_has_many_keys(canary: Stack) -> None:
    """Eight honest API keys; the challenger's slice sees users of four of them (the others' few users all route
    to the champion). One key sends 60 down-votes to the challenger under made-up users. The canary has nine
    keys, more than 1 / max_key_share (5), so the key cap applies to each side as it does to a round's snapshot:
    counted per side, the challenger's five keys were 'few', the flood kept all its weight and aborted a
    challenger users rate like the champion."""
    chall = honest("both", 16, 4, 8, keys=4)  # keys 0-3, half the users vote up
    champ = chall + [(f"key-{4 + u % 4}", f"champ-{u}", u % 2 == 0) for u in range(16) for _ in range(4)]
    feedback(canary, "2", chall + flood("key", up=False))
    feedback(canary, "1", champ)

    view = canary.monitor.check_canary(MODEL)

    assert view["decision"] != "abort", view
    assert view["challenger"]["n"] <= 64 + 16, "the flood weighs at most one key's share (0.2) of the side"


def test_one_trace_of_a_new_user_does_not_cut_a_side_of_few_users_to_one_trace_each(canary: Stack) -> None:
    """Four apps that send no ``user`` (one user per key), 40 votes each on both sides. One trace of a fifth user
    on the challenger's side cut that side from 160 events to 5: the canary waits for min_feedback until
    max_duration_s aborts it, and the monitors have too few answers to judge; the round's split cuts the same
    way."""
    apps = [(f"key-{u}", f"app-{u}", i % 2 == 0) for u in range(4) for i in range(40)]
    feedback(canary, "2", [*apps, ("key-0", "mallory", False)])
    feedback(canary, "1", apps)

    view = canary.monitor.check_canary(MODEL)

    assert view["challenger"]["n"] >= 160, view
