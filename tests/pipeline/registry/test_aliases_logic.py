"""Alias history and rollback-target logic of :mod:`pipeline.registry.aliases`, on an in-memory registry.

The same moves are proven against a real MLflow server in ``test_registry.py`` and ``test_serving.py``;
these run in milliseconds and cover the branches: who moved the alias, failed versions, the history cap.
"""

from __future__ import annotations

import json

import pytest
from mlflow.exceptions import MlflowException

from pipeline.registry import aliases
from pipeline.registry.aliases import PREVIOUS_ALIAS, TAG_HISTORY, TAG_PROMOTED_BY, TAG_SERVE_ERROR, UnknownVersionError
from pipeline.config import HourglassConfig
from pipeline.registry.models import RegistryError
from tests.pipeline.registry_fakes import FakeRegistry

MODEL = "hourglass"


@pytest.fixture
def cfg() -> HourglassConfig:
    return HourglassConfig()


@pytest.fixture
def reg() -> FakeRegistry:
    registry = FakeRegistry()
    registry.add_versions(MODEL, 5)
    return registry


def champion(reg: FakeRegistry) -> str | None:
    return reg.alias(MODEL, "champion")


def test_first_promote_sets_the_champion_and_starts_the_history(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    out = aliases.promote(cfg, MODEL, "1", client=reg, reason="round r1")

    assert out == {"model": MODEL, "version": "1", "previous": None}
    assert champion(reg) == "1"
    assert aliases.history(reg, MODEL) == ["1"]
    assert reg.alias(MODEL, PREVIOUS_ALIAS) is None
    assert reg.tags(MODEL, "1")[TAG_PROMOTED_BY].startswith("round r1 at ")


def test_each_promote_appends_and_names_the_previous_champion(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    for version in ("1", "2", "3"):
        aliases.promote(cfg, MODEL, version, client=reg)

    assert champion(reg) == "3"
    assert aliases.history(reg, MODEL) == ["1", "2", "3"]
    assert reg.alias(MODEL, PREVIOUS_ALIAS) == "2"


def test_promoting_the_champion_again_does_not_repeat_it_in_the_history(
    cfg: HourglassConfig, reg: FakeRegistry
) -> None:
    aliases.promote(cfg, MODEL, "1", client=reg)
    aliases.promote(cfg, MODEL, "2", client=reg)
    out = aliases.promote(cfg, MODEL, "2", client=reg)

    assert out["previous"] == "2"
    assert aliases.history(reg, MODEL) == ["1", "2"]
    assert reg.alias(MODEL, PREVIOUS_ALIAS) == "1"


def test_an_alias_moved_outside_hourglass_is_remembered_at_the_next_promote(
    cfg: HourglassConfig, reg: FakeRegistry
) -> None:
    aliases.promote(cfg, MODEL, "1", client=reg)
    reg.set_registered_model_alias(MODEL, "champion", "4")  # e.g. moved in the MLflow UI

    out = aliases.promote(cfg, MODEL, "2", client=reg)

    assert out["previous"] == "4"
    assert aliases.history(reg, MODEL) == ["1", "4", "2"]
    assert reg.alias(MODEL, PREVIOUS_ALIAS) == "4"


def test_promote_clears_a_serve_error_so_the_controller_retries(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    reg.set_model_version_tag(MODEL, "2", TAG_SERVE_ERROR, "probe failed")

    aliases.promote(cfg, MODEL, "2", client=reg)

    assert TAG_SERVE_ERROR not in reg.tags(MODEL, "2")
    assert champion(reg) == "2"


def test_promote_of_an_unknown_version_is_refused_and_moves_nothing(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    aliases.promote(cfg, MODEL, "1", client=reg)

    with pytest.raises(UnknownVersionError, match="has no version '9'.*hourglass models list"):
        aliases.promote(cfg, MODEL, "9", client=reg)
    with pytest.raises(LookupError):  # the builtin it also inherits
        aliases.promote(cfg, MODEL, "9", client=reg)

    assert champion(reg) == "1"
    assert aliases.history(reg, MODEL) == ["1"]


def test_history_is_capped_at_fifty_versions(cfg: HourglassConfig) -> None:
    reg = FakeRegistry()
    versions = reg.add_versions(MODEL, 60)
    for version in versions:
        aliases.promote(cfg, MODEL, version, client=reg)

    past = aliases.history(reg, MODEL)
    assert len(past) == 50
    assert past[0] == "11" and past[-1] == "60"


def test_a_damaged_history_tag_reads_as_empty_and_is_rewritten(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    reg.set_registered_model_tag(MODEL, TAG_HISTORY, "{not json")
    assert aliases.history(reg, MODEL) == []

    aliases.promote(cfg, MODEL, "3", client=reg)

    assert json.loads(reg.models[MODEL].tags[TAG_HISTORY]) == ["3"]


def test_rollback_returns_to_the_latest_earlier_champion_that_served(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    for version in ("1", "2", "3", "4"):
        aliases.promote(cfg, MODEL, version, client=reg)
    reg.set_model_version_tag(MODEL, "3", TAG_SERVE_ERROR, "staging refused: checksum mismatch")

    out = aliases.rollback(cfg, MODEL, client=reg)

    assert out == {"model": MODEL, "version": "2", "previous": "4"}
    assert champion(reg) == "2"
    assert aliases.history(reg, MODEL) == ["1", "2"]  # cut after the target
    assert reg.alias(MODEL, PREVIOUS_ALIAS) == "1"


def test_rollback_twice_walks_further_back(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    for version in ("1", "2", "3"):
        aliases.promote(cfg, MODEL, version, client=reg)

    aliases.rollback(cfg, MODEL, client=reg)
    out = aliases.rollback(cfg, MODEL, client=reg)

    assert out["version"] == "1" and out["previous"] == "2"
    assert aliases.history(reg, MODEL) == ["1"]
    assert reg.alias(MODEL, PREVIOUS_ALIAS) is None


def test_rollback_skips_the_current_champion_wherever_it_appears(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    for version in ("1", "2", "1", "2"):
        aliases.promote(cfg, MODEL, version, client=reg)

    out = aliases.rollback(cfg, MODEL, client=reg)

    assert out["version"] == "1"
    assert aliases.history(reg, MODEL) == ["1", "2", "1"]


def test_rollback_without_an_earlier_champion_says_how_to_name_one(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    aliases.promote(cfg, MODEL, "1", client=reg)

    with pytest.raises(RegistryError, match=r"no earlier champion.*--to VERSION"):
        aliases.rollback(cfg, MODEL, client=reg)
    assert champion(reg) == "1"


def test_rollback_when_every_earlier_champion_failed_is_refused(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    for version in ("1", "2", "3"):
        aliases.promote(cfg, MODEL, version, client=reg)
    for version in ("1", "2"):
        reg.set_model_version_tag(MODEL, version, TAG_SERVE_ERROR, "probe failed")

    with pytest.raises(RegistryError, match="no earlier champion"):
        aliases.rollback(cfg, MODEL, client=reg)
    assert champion(reg) == "3"


def test_rollback_to_a_named_version_clears_its_serve_error_and_records_it(
    cfg: HourglassConfig, reg: FakeRegistry
) -> None:
    aliases.promote(cfg, MODEL, "1", client=reg)
    aliases.promote(cfg, MODEL, "2", client=reg)
    reg.set_model_version_tag(MODEL, "5", TAG_SERVE_ERROR, "replica refused the load")

    out = aliases.rollback(cfg, MODEL, "5", client=reg)

    assert out == {"model": MODEL, "version": "5", "previous": "2"}
    assert TAG_SERVE_ERROR not in reg.tags(MODEL, "5")
    assert aliases.history(reg, MODEL) == ["1", "2", "5"]
    assert reg.alias(MODEL, PREVIOUS_ALIAS) == "2"


def test_rollback_to_an_unknown_version_is_refused(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    aliases.promote(cfg, MODEL, "1", client=reg)
    with pytest.raises(UnknownVersionError):
        aliases.rollback(cfg, MODEL, "42", client=reg)
    assert champion(reg) == "1"


def test_revert_failed_tags_the_version_and_returns_the_alias_to_the_served_one(
    cfg: HourglassConfig, reg: FakeRegistry
) -> None:
    aliases.promote(cfg, MODEL, "1", client=reg)
    aliases.promote(cfg, MODEL, "2", client=reg)
    aliases.promote(cfg, MODEL, "3", client=reg)

    aliases.revert_failed(reg, cfg, MODEL, "3", "probe through 'hourglass-v3' at http://10.0.0.5:8000 failed", "2")

    assert champion(reg) == "2"
    assert aliases.history(reg, MODEL) == ["1", "2"]
    assert reg.alias(MODEL, PREVIOUS_ALIAS) == "1"
    assert "probe through 'hourglass-v3'" in reg.tags(MODEL, "3")[TAG_SERVE_ERROR]


def test_revert_failed_leaves_an_alias_someone_moved_meanwhile(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    aliases.promote(cfg, MODEL, "1", client=reg)
    aliases.promote(cfg, MODEL, "2", client=reg)
    aliases.promote(cfg, MODEL, "4", client=reg)  # the operator moved on while v2 was being loaded

    aliases.revert_failed(reg, cfg, MODEL, "2", "staging refused", "1")

    assert champion(reg) == "4"
    assert reg.tags(MODEL, "2")[TAG_SERVE_ERROR] == "staging refused"
    assert aliases.history(reg, MODEL) == ["1", "2", "4"]


def test_revert_failed_without_a_served_version_drops_the_alias(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    aliases.promote(cfg, MODEL, "1", client=reg)

    aliases.revert_failed(reg, cfg, MODEL, "1", "staging refused", None)

    assert champion(reg) is None
    assert aliases.history(reg, MODEL) == []


def test_revert_failed_puts_a_served_version_missing_from_the_history_back_on_top(
    cfg: HourglassConfig, reg: FakeRegistry
) -> None:
    reg.set_registered_model_alias(MODEL, "champion", "3")  # moved by hand: no history

    aliases.revert_failed(reg, cfg, MODEL, "3", "load refused", "2")

    assert champion(reg) == "2"
    assert aliases.history(reg, MODEL) == ["2"]


def test_champion_version_is_none_when_absent_and_raises_when_mlflow_is_down(
    cfg: HourglassConfig, reg: FakeRegistry
) -> None:
    assert aliases.champion_version(reg, MODEL, "champion") is None
    assert aliases.champion_version(reg, "no-such-model", "champion") is None

    reg.down = True
    with pytest.raises(MlflowException, match="connection refused"):
        aliases.champion_version(reg, MODEL, "champion")


def test_describe_model_lists_versions_aliases_and_history(cfg: HourglassConfig, reg: FakeRegistry) -> None:
    aliases.promote(cfg, MODEL, "1", client=reg)
    aliases.promote(cfg, MODEL, "2", client=reg)

    out = aliases.describe_model(reg, MODEL)

    assert out["aliases"] == {"champion": "2", PREVIOUS_ALIAS: "1"}
    assert out["champion_history"] == ["1", "2"]
    assert [v["version"] for v in out["versions"]] == ["1", "2", "3", "4", "5"]
    assert out["versions"][1]["aliases"] == ["champion"]
    assert out["versions"][0]["aliases"] == [PREVIOUS_ALIAS]
