"""The ``promote`` step with the canary off (:func:`pipeline.registry.models.promote_winners`), on an
in-memory registry: it moves ``@champion``, moving it again is a no-op (a resumed round promotes once),
and a version from an older round than the champion's is tagged, not promoted."""

from __future__ import annotations

import pytest

from pipeline.config import HourglassConfig
from pipeline.registry.aliases import TAG_HISTORY
from pipeline.registry.client import TAG_ROUND
from pipeline.registry.models import TAG_NOT_PROMOTED, promote_winners
from tests.pipeline.registry_fakes import FakeRegistry

MODEL = "hourglass"


@pytest.fixture
def cfg() -> HourglassConfig:
    return HourglassConfig()


def test_promote_moves_the_champion_once_however_often_it_runs(cfg: HourglassConfig) -> None:
    reg = FakeRegistry()
    [v1] = reg.add_versions(MODEL, 1, **{TAG_ROUND: "r20260101T000000-aaaaaa"})
    first = promote_winners(cfg, "r20260101T000000-aaaaaa", {MODEL: v1}, client=reg)  # type: ignore[arg-type]
    again = promote_winners(cfg, "r20260101T000000-aaaaaa", {MODEL: v1}, client=reg)  # type: ignore[arg-type]
    assert (
        first
        == again
        == [{"model": MODEL, "version": v1, "action": "promoted", "reason": "round r20260101T000000-aaaaaa"}]
    )
    assert reg.alias(MODEL, "champion") == v1
    assert reg.models[MODEL].tags[TAG_HISTORY] == f'["{v1}"]'  # the second run added nothing


def test_a_version_from_an_older_round_is_tagged_and_not_promoted(cfg: HourglassConfig) -> None:
    reg = FakeRegistry()
    [newer] = reg.add_versions(MODEL, 1, **{TAG_ROUND: "r20260102T000000-bbbbbb"})
    [older] = reg.add_versions(MODEL, 1, **{TAG_ROUND: "r20260101T000000-aaaaaa"})
    promote_winners(cfg, "r20260102T000000-bbbbbb", {MODEL: newer}, client=reg)  # type: ignore[arg-type]
    [outcome] = promote_winners(cfg, "r20260101T000000-aaaaaa", {MODEL: older}, client=reg)  # type: ignore[arg-type]
    assert outcome["action"] == "not_promoted" and "older than the champion" in outcome["reason"]
    assert reg.alias(MODEL, "champion") == newer
    assert "older than the champion v1's round" in reg.tags(MODEL, older)[TAG_NOT_PROMOTED]


def test_nothing_to_promote_calls_nothing(cfg: HourglassConfig) -> None:
    reg = FakeRegistry()
    assert promote_winners(cfg, "r1", {}, client=reg) == []  # type: ignore[arg-type]
    assert reg.calls == []
