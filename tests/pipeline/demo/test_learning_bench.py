"""bench/learning.py's table over seeds: the median and spread of the final accuracy, every canary with both sides'
rates, worse promotions and failed runs failing the target."""

from __future__ import annotations

from bench.learning import canary_cell, table
from bench.poisoning import Canary, Run, parse


def test_reads_the_live_rate_ratio_forgetting_and_load_lines() -> None:
    assert parse("last phase / first phase thumbs-up rate: 5.7x\n").live_ratio == 5.7
    assert parse("last phase / first phase success rate: 2.3x\n").live_ratio == 2.3
    assert parse("").live_ratio is None
    run = parse(
        "regression suite reasoning: base 0.094, final champion (hourglass-v4) 0.078 on 64 prompts; forgetting "
        "(base - champion) +0.016, within the target <= 0.05\n"
        "total time 1530 s on 2 CPUs; load average (1, 5, 15 min) 3.0, 2.9, 2.5\n"
    )
    assert run.forgetting == 0.016 and run.load == "3.0 / 2.9" and run.total_s == 1530


def test_reads_the_explicit_only_line_the_scoreboard_printed() -> None:
    from pipeline.demo.board import explicit_only_line

    run = parse(explicit_only_line(0.083, 0.396, 0.125, "hourglass-explicit-v2", 0.05, 3) + "\n")
    assert run.explicit_only == 0.125
    columns, rows, _ = table([(1, 0, run, 60.0, "-")])
    assert rows[0][columns.index("explicit-only line (same traffic)")] == "0.125"
    assert parse("").explicit_only is None


def test_median_spread_and_target() -> None:
    promoted = Canary(1, "1", (20, 40), "base", (10, 40), "PROMOTED")
    runs = [Run(accuracy=[0.3, a], canaries=[promoted]) for a in (0.5, 0.7, 0.65)]
    columns, rows, result = table([(s, 0, r, 600.0, "2.0 / 2.0") for s, r in enumerate(runs)])
    assert result.startswith("3 seeds: median final accuracy 0.650 (spread 0.500-0.700")
    assert result.endswith("PASS")
    assert rows[0][columns.index("canaries (users' thumbs-up, challenger vs replaced side)")] == (
        "r1 v1 50% (20/40) vs base 25% (10/40) PROMOTED"
    )
    assert rows[0][columns.index("wall")] == "10.0 min"


def test_a_worse_promotion_a_low_median_or_a_failed_run_fails() -> None:
    worse = Canary(2, "2", (3, 12), "v1", (6, 12), "PROMOTED")
    assert canary_cell(worse).endswith("PROMOTED WORSE")
    columns, rows, result = table([(0, 0, Run(accuracy=[0.8], canaries=[worse], forgetting=0.02), 1.0, "-")])
    assert rows[0][columns.index("forgetting (shipped suite, base - champion)")] == "+0.020"
    assert (
        rows[0][columns.index("worse promotions")] == 1 and "worse promotions 1" in result and result.endswith("FAIL")
    )
    _, _, result = table([(0, 0, Run(accuracy=[0.59]), 1.0, "-")])
    assert result.endswith("FAIL")
    _, rows, result = table([(0, 0, Run(accuracy=[0.9]), 1.0, "-"), (1, 1, Run(), 1.0, "-")])
    assert rows[1][1] == "failed (exit 1)" and "failed runs 1" in result and result.endswith("FAIL")
    assert "median final accuracy 0.900" in result  # the failed seed is not counted as an accuracy
