"""The demo's scoreboard helpers on small tables."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.demo.board import gain_ratio, live_rates, plot_live_rates
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


def test_gain_ratio() -> None:
    assert gain_ratio(0.1, 0.4, 0.7) == pytest.approx(0.5)
    assert math.isnan(gain_ratio(0.5, 0.6, 0.5))


def test_oracle_reward_is_the_users_check() -> None:
    cases = [("13", "13"), ("13, because 9 + 4 = 13", "13"), ("9 + 4 = 13", "13"), ("1,300", "1300"), ("no idea", "4"), ("4", "four")]
    for answer, reference in cases:
        assert first_number_answer([], answer, {"reference_answer": reference}) == float(is_correct(answer, reference))
    assert is_correct("13, because", "13") and not is_correct("9 + 4 = 13", "13")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rates = live_rates(pa.table({"trace_id": ["a", "b"], "adapter_version": [None, "1"], "reward": [-1.0, 1.0]}), [["a"], ["b"]])
    plot_live_rates(rates, tmp_path / "live.png")
    assert (tmp_path / "live.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name", ["demo.toml", "hourglass.toml", "production.toml"])
def test_shipped_configs_learn_from_feedback_without_reference_answers(name: str) -> None:
    """The served model's candidates and gate use no reference answer; only the demo's oracle does,
    and it is its own served model (it never competes for `hourglass`)."""
    from pipeline.config import load_config
    from pipeline.demo.main import ORACLE_MODEL

    cfg = load_config(REPO / "deploy" / name)
    assert cfg.rl.gate_metric in ("feedback", "reward_model")
    served = [c for c in cfg.candidates if c.served_model == cfg.serving.model_name]
    assert {c.algorithm for c in served} >= {"grpo", "kto"}
    assert all(t.fn not in ("exact_answer", "first_number_answer") for c in served for t in c.reward)
    assert any(t.fn == "reward_model" for c in served for t in c.reward)
    others = [c for c in cfg.candidates if c.served_model != cfg.serving.model_name]
    if name == "demo.toml":
        assert [(c.served_model, [t.fn for t in c.reward]) for c in others] == [(ORACLE_MODEL, ["first_number_answer"])]
    else:
        assert others == []


def test_round_printout_survives_nulls_from_the_api() -> None:
    """The ops API sends NaN as null (a gate without usable rows, a reward model without AUC)."""
    from pipeline.demo.main import _num, _print_round

    record = {
        "state": "no_winner", "metrics": {"reward_model/auc": None},
        "decisions": {"hourglass": {"winner": None, "reason": "keep base: none of the 3 held-out rows ...", "metric": "feedback",
                                    "champion_reward": None, "candidate_rewards": {"kto": None}, "lower_bounds": {"kto": None}}},
    }  # fmt: skip
    _print_round(record, 96, {"trace_rows": 96})
    assert _num(None) == "-" and _num(float("nan")) == "-" and _num(0.5, "+.3f") == "+0.500"
