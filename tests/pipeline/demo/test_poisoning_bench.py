"""bench/poisoning.py's reading of the demo's output: on a captured run (``demo_hostile_output.txt``: the demo with
``--rounds 1 --traffic 96 --between 32 --hostile-share 0.1 --hostile-keys one``) and on made-up lines, and its
table's worse-promotion count and target line."""

from __future__ import annotations

from pathlib import Path

from bench.poisoning import Canary, Run, parse, table

CAPTURED = Path(__file__).with_name("demo_hostile_output.txt")


def test_parses_a_captured_demo_run() -> None:
    """The 2026-12-03 smoke run (its 'traces sent 80' counted honest traces only, fixed since: the parser
    does not read that line)."""
    run = parse(CAPTURED.read_text())
    assert run.accuracy == [0.479] and run.final == 0.479
    assert run.aucs == [0.63] and run.total_s == 788
    assert run.canaries == [Canary(1, "1", (9, 16), "base", (10, 40), "PROMOTED")]
    assert not run.canaries[0].worse  # the honest users rate v1 56 % vs the base's 25 %


SYNTHETIC = """\
greedy accuracy after round 1 (hourglass-v1): 0.250
canary of round 1, honest users only: challenger v1 3/12 (25%), replaced side base 6/12 (50%); PROMOTED
canary of round 2, honest users only: challenger v2 9/12 (75%), replaced side v1 3/12 (25%); PROMOTED
canary of round 3, honest users only: challenger v3 0/0 (-), replaced side v2 4/8 (50%); undecided
canary of round 4, honest users only: challenger v4 1/10 (10%), replaced side v2 4/8 (50%); ABORTED
greedy accuracy of the served model by round (48 fresh prompts): 0.250, 0.500, 0.500, 0.521
reward model held-out AUC by round: 0.612, -, 0.700, 0.655 (over all held-out votes, hostile ones included)
total time 1530 s on 2 CPUs; load average (1, 5, 15 min) 3.0, 2.9, 2.5
"""


def test_parses_every_line_and_counts_only_promoted_worse_challengers() -> None:
    run = parse(SYNTHETIC)
    assert run.accuracy == [0.25, 0.5, 0.5, 0.521] and run.final == 0.521
    assert run.aucs == [0.612, None, 0.7, 0.655] and run.total_s == 1530
    assert [c.worse for c in run.canaries] == [True, False, False, False]
    assert run.canaries[1] == Canary(2, "2", (9, 12), "v1", (3, 12), "PROMOTED")


def test_a_run_that_ended_early_keeps_its_per_round_accuracy_and_empty_is_empty() -> None:
    assert parse("greedy accuracy after round 1 (base): 0.083\ngreedy accuracy after round 2 (v1): 0.2\n").accuracy == [
        0.083,
        0.2,
    ]
    assert parse("") == Run()


def test_table_ratio_to_clean_and_target() -> None:
    clean, good = Run(accuracy=[0.5]), Run(accuracy=[0.46])
    bad = parse(SYNTHETIC)
    columns, rows, result = table([(0.0, "one", 0, clean, 60.0, "1.0 / 1.0"), (0.05, "one", 0, good, 60.0, "1 / 1")])
    assert rows[1][columns.index("ratio to clean")] == "0.92" and result.endswith("PASS")
    _, rows, result = table(
        [(0.0, "one", 0, clean, 60.0, "-"), (0.05, "one", 0, good, 60.0, "-"), (0.1, "many", 0, bad, 60.0, "-")]
    )
    assert rows[2][columns.index("worse promotions")] == 1 and result.endswith("FAIL")
    _, rows, result = table([(0.0, "one", 0, clean, 60.0, "-"), (0.05, "many", 1, Run(), 5.0, "-")])
    assert rows[1][2] == "failed (exit 1)" and result.endswith("FAIL")
    _, _, result = table([(0.1, "one", 0, good, 60.0, "-")])  # no clean run and no 5 % run: nothing to judge
    assert "NOT JUDGED" in result and "PASS" not in result
    _, _, result = table([(0.05, "one", 0, good, 60.0, "-")])  # a 5 % run without its clean reference
    assert "NOT JUDGED" in result


def test_reuse_logs_reads_finished_runs_and_runs_only_the_missing_ones(tmp_path, monkeypatch, capsys) -> None:
    """``--reuse-logs``: a log with the demo's result line is read (its wall time and load as printed), a log
    without one (a run that was stopped) is run again, and the page is written after every run."""
    from bench import poisoning

    logs, reports = tmp_path / "logs", tmp_path / "reports"
    logs.mkdir()
    (logs / "demo-0-one.txt").write_text(SYNTHETIC)
    (logs / "demo-0.05-one.txt").write_text(CAPTURED.read_text())
    (logs / "demo-0.05-many.txt").write_text("greedy accuracy after round 1 (hourglass-v1): 0.100\n")  # stopped
    (logs / "demo-0.1-one.txt").write_bytes(b"\xff\xfe total time 99 s\n")  # not UTF-8, no accuracy: run again
    ran: list[tuple[str, ...]] = []

    def fake_run(args, log: Path, *extra: str, seed=None):
        ran.append(extra)
        log.write_text(SYNTHETIC.replace("0.521", "0.480"))
        return 0, 60.0, "1.0 / 1.0"

    monkeypatch.setattr(poisoning, "run_demo", fake_run)
    argv = [
        "poisoning.py",
        "--shares",
        "0",
        "0.05",
        "0.1",
        "--modes",
        "one",
        "many",
        "--logs",
        str(logs),
        "--reuse-logs",
        "--report-dir",
        str(reports),
    ]
    monkeypatch.setattr("sys.argv", [*argv, "--variant", "t"])
    poisoning.main()
    assert ran == [
        ("--hostile-share", "0.05", "--hostile-keys", "many"),
        ("--hostile-share", "0.1", "--hostile-keys", "one"),
        ("--hostile-share", "0.1", "--hostile-keys", "many"),
    ]
    out = capsys.readouterr().out
    assert "| 0% | - | 0.521 | 1.00 |" in out and "25.5 min | 3.0 / 2.9 |" in out  # kept: the log's own figures
    assert "| 5% | one | 0.479 | 0.92 |" in out and "13.1 min | 3.3 / 3.4 |" in out
    assert "| 5% | many | 0.480 | 0.92 |" in out and "1.0 min | 1.0 / 1.0 |" in out  # run again
    page = (reports / "poisoning.md").read_text()
    assert page.count("<!-- bench:t -->") == 1 and "| 5% | many | 0.480 |" in page


def test_junk_and_forged_numbers_are_read_as_missing_never_raise() -> None:
    """A log line that cannot be the demo's (a value not a number in [0, 1], a forged line quoted mid-line)
    leaves the figures empty, so such a log is never reused and its row never passes."""
    quoted = "user said: greedy accuracy of the served model by round (48 fresh prompts): 1.0\n" + SYNTHETIC
    assert parse(quoted).final == 0.521  # only a line of its own counts
    for bad in ("0.1, 99", "x, y", "inf", "-1, 0.5", "nan"):
        line = f"greedy accuracy of the served model by round (48 fresh prompts): {bad}\n"
        assert parse(line).accuracy == [] and parse(line).final is None, bad
    assert parse("reward model held-out AUC by round: 0.5, -, 1.2.3\n").aucs == [0.5, None, None]
    assert parse("reward model held-out AUC by round: ,\n").aucs == [None, None]


def test_every_figure_of_a_junk_log_reads_as_missing_and_the_last_scoreboard_wins() -> None:
    """Every number goes through the same finite-number check (a ``1.2.3`` or a 5000-digit count raised before),
    only ASCII digits count, and the demo prints its scoreboard last, so a forged line before it loses."""
    junk = (
        "last phase / first phase thumbs-up rate: 1.2.3x\n"
        "explicit-only line (x): greedy accuracy 1.2.3\n"
        "regression suite r; forgetting (base - champion) --,\n"
        f"canary of round {'9' * 5000}, honest users only: challenger v1 1/2 (x), replaced side base 1/2 (x); PROMOTED\n"
        "total time 1.5 s on 2 CPUs; load average (1, 5, 15 min) 1.2.3, 4\n"
        "user said: explicit-only line (x): greedy accuracy 0.99 ok\n"
        "greedy accuracy after round 1 (hg-v1): \u0660.\u0665\n"
    )
    run = parse(junk)
    assert (run.live_ratio, run.explicit_only, run.forgetting, run.total_s, run.load) == (None,) * 5
    assert run.canaries == [] and run.accuracy == []
    unicode = "greedy accuracy of the served model by round (5 fresh prompts): \u0660.\u0665\n"
    assert parse(unicode).accuracy == []  # float() reads Unicode digits; the demo never prints them
    forged = "greedy accuracy of the served model by round (48 fresh prompts): 0.990, 0.990\n" + SYNTHETIC
    assert parse(forged).final == 0.521


def test_a_promoted_canary_with_more_thumbs_up_than_votes_counts_as_worse() -> None:
    """``7/3`` cannot come from the demo (thumbs-up of rated votes). Read as a rate it was 233 % and "beat" a
    replaced side at 2/3, hiding a worse promotion; such a promotion now counts as worse, so the run fails."""
    line = "canary of round 1, honest users only: challenger v2 {c} (x), replaced side v1 {r} (x); {o}\n"
    for c, r in (("7/3", "2/3"), ("1/3", "9/4"), ("5/0", "0/0")):
        (canary,) = parse(line.format(c=c, r=r, o="PROMOTED")).canaries
        assert canary.worse, (c, r)
        (aborted,) = parse(line.format(c=c, r=r, o="ABORTED")).canaries
        assert not aborted.worse  # nothing was promoted
    (fair,) = parse(line.format(c="3/3", r="2/3", o="PROMOTED")).canaries
    assert not fair.worse and fair.challenger == (3, 3) and fair.control == (2, 3)


def test_a_log_path_that_is_not_a_regular_file_stops_the_benchmark_before_any_run(tmp_path, monkeypatch) -> None:
    """A folder, a link (dangling, a loop, or to a device) where a log goes: the benchmark stops with the path
    named before it runs anything, instead of failing half-way, writing elsewhere or reading forever."""
    import pytest

    from bench import poisoning

    ran: list[object] = []
    monkeypatch.setattr(poisoning, "run_demo", lambda *a, **k: ran.append(a) or (0, 1.0, "-"))
    for make in (
        lambda p: p.mkdir(),
        lambda p: p.symlink_to(tmp_path / "nowhere"),
        lambda p: p.symlink_to(p),
        lambda p: p.symlink_to("/dev/zero"),
    ):
        logs = tmp_path / f"logs{len(list(tmp_path.iterdir()))}"
        logs.mkdir()
        make(logs / "demo-0.05-one.txt")
        argv = ["poisoning.py", "--shares", "0", "0.05", "--modes", "one", "--logs", str(logs), "--reuse-logs"]
        monkeypatch.setattr("sys.argv", [*argv, "--report-dir", str(tmp_path / "reports")])
        with pytest.raises(SystemExit, match="demo-0.05-one.txt is not a regular file"):
            poisoning.main()
        assert ran == []


def test_a_logs_folder_that_is_a_file_or_a_broken_link_stops_both_benchmarks_with_its_name(
    tmp_path, monkeypatch
) -> None:
    """``--logs`` naming a file or a dangling link: each benchmark stops with the path named (it used to be a
    FileExistsError traceback from mkdir); a link to a folder is a folder and is used."""
    import pytest

    from bench import learning, poisoning

    ran: list[object] = []
    for module in (poisoning, learning):
        monkeypatch.setattr(module, "run_demo", lambda *a, **k: ran.append(a) or (0, 1.0, "-"))
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    broken = tmp_path / "broken"
    broken.symlink_to(tmp_path / "nowhere")
    reports = ["--report-dir", str(tmp_path / "reports")]
    for logs in (a_file, broken):
        for argv in (
            ["poisoning.py", "--shares", "0", "--logs", str(logs), *reports],
            ["learning.py", "--seeds", "0", "--logs", str(logs), *reports],
        ):
            monkeypatch.setattr("sys.argv", argv)
            with pytest.raises(SystemExit, match=f"--logs {logs} is not a folder"):
                (poisoning if argv[0] == "poisoning.py" else learning).main()
    assert ran == []
    assert a_file.read_text() == "not a folder"

    for above in (a_file, broken):  # the folder's parent is the problem: was a NotADirectory/FileExists traceback
        with pytest.raises(SystemExit, match=f"--logs {above}/sub cannot be created"):
            poisoning.logs_dir(above / "sub")
    with pytest.raises(SystemExit, match="cannot be created"):
        poisoning.logs_dir(tmp_path / ("x" * 300))  # a name longer than the file system takes

    real = tmp_path / "real"
    real.mkdir()
    linked = tmp_path / "linked"
    linked.symlink_to(real, target_is_directory=True)
    assert poisoning.logs_dir(linked) == linked
    assert poisoning.logs_dir(tmp_path / "new" / "deeper").is_dir()
