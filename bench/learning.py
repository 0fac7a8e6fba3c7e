"""Learning over seeds (issue #28 item 5): the demo's whole loop, once per seed, and what each run promoted.

One run is an anecdote. This runs ``python -m pipeline.demo --seed S`` for each seed (a subprocess each, one after
the other: they share the stack's ports and state) and prints, per seed, the final greedy accuracy on the demo's
fresh prompts (the users' own check), the accuracy by round, the users' live rate last phase / first phase, and
every canary with both sides' live verdict (the challenger and the side it would replace) and its outcome: the
users' thumbs-up where every answer is rated, their own check of the served answers where few are
(``-- --rating-rate 0.05``). A *worse promotion* is a promoted challenger whose users' live rate (point estimate) is
below the replaced side's. The result line gives the median final accuracy, its spread (min-max) and the worse promotions.

Targets: no worse promotion in any seed; median final accuracy >= 0.6.

    python bench/learning.py [--seeds 0 1 2 3 4] [--rounds 4] [--traffic 192] [--between 96] [-- DEMO FLAGS]

Flags after ``--`` go to every demo run unchanged, e.g. ``-- --rating-rate 0.05`` for the sparse-feedback
scenario (issue #27); the canary's settings are read from the environment as the demo reads them
(``HOURGLASS_SERVING__CANARY__MARGIN=0.05 python bench/learning.py``). One seed of the default demo takes 20-40
min on the 2-core dev host; each run's full output is kept under ``--logs``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import writer  # noqa: E402
from bench.poisoning import Canary, Run, checked_log, fmt, logs_dir, read_log, run_demo  # noqa: E402

TARGET_MEDIAN = 0.6


def canary_cell(c: Canary) -> str:
    """``r2 v3 35% (21/60) vs v2 41% (55/133) PROMOTED``, with ``WORSE`` after a worse promotion."""

    def side(up: int, n: int) -> str:
        return f"{up / n:.0%} ({up}/{n})" if n else "- (0/0)"

    text = f"r{c.round} v{c.version} {side(*c.challenger)} vs {c.replaced} {side(*c.control)} {c.outcome}"
    return text + (" WORSE" if c.worse else "")


def table(results: list[tuple[int, int, Run, float, str]]) -> tuple[list[str], list[list[object]], str]:
    """The columns, rows and result line of ``results`` (seed, exit status, run, wall s, load)."""
    columns = [
        "seed",
        "final greedy accuracy",
        "accuracy by round",
        "live rate last / first",
        "explicit-only line (same traffic)",
        "forgetting (shipped suite, base - champion)",
        "canaries (users' thumbs-up, challenger vs replaced side)",
        "worse promotions",
        "wall",
        "load 1/5 min",
    ]
    rows: list[list[object]] = []
    finals: list[float] = []
    failed = 0
    for seed, rc, run, wall_s, load in results:
        ok = rc == 0 and run.final is not None
        if ok:
            finals.append(run.final)  # type: ignore[arg-type]
        else:
            failed += 1
        rows.append(
            [
                seed,
                fmt(run.final) if ok else f"failed (exit {rc})",
                ", ".join(fmt(a) for a in run.accuracy) or "-",
                fmt(run.live_ratio, ".1f") + "x" if run.live_ratio is not None else "-",
                fmt(run.explicit_only),
                fmt(run.forgetting, "+.3f"),
                "; ".join(canary_cell(c) for c in run.canaries) or "-",
                sum(c.worse for c in run.canaries),
                f"{wall_s / 60:.1f} min",
                load,
            ]
        )
    worse = sum(sum(c.worse for c in run.canaries) for _, _, run, _, _ in results)
    median = statistics.median(finals) if finals else None
    spread = f"{min(finals):.3f}-{max(finals):.3f}" if finals else "-"
    ok = failed == 0 and worse == 0 and median is not None and median >= TARGET_MEDIAN
    result = (
        f"{len(results)} seeds: median final accuracy {fmt(median)} (spread {spread}; target >= {TARGET_MEDIAN:g}); "
        f"worse promotions {worse} (target 0); failed runs {failed}: {'PASS' if ok else 'FAIL'}"
    )
    return columns, rows, result


def main() -> None:
    argv = sys.argv[1:]
    demo_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("deploy/demo.toml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--traffic", type=int, default=192)
    parser.add_argument("--between", type=int, default=96)
    parser.add_argument("--variant", default="", help="report section name (default: from the settings)")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "hourglass-learning")
    parser.add_argument(
        "--from-logs",
        action="store_true",
        help="run nothing: rebuild the table from the seeds' kept logs under --logs (wall time and load as each demo "
        "printed them)",
    )
    writer.add_arguments(parser)
    args = parser.parse_args(argv)
    args.seed = args.seeds[0]
    recorder = writer.Recorder("learning", args)
    logs_dir(args.logs)
    results: list[tuple[int, int, Run, float, str]] = []
    for seed in args.seeds:
        log = checked_log(args.logs / f"demo-seed{seed}.txt")
        if args.from_logs:
            if not log.exists():
                continue
            run = read_log(log)
            if run.total_s is None:
                print(f"seed {seed}: {log} has no result line (still running, or stopped): left out", file=sys.stderr)
                continue
            rc, wall_s, load = 0, run.total_s, run.load or "-"
        else:
            rc, wall_s, load = run_demo(args, log, *demo_flags, seed=seed)
            run = read_log(log)
        results.append((seed, rc, run, wall_s, load))
        columns, rows, result = table(results)
        print(writer.markdown_table(columns, rows[-1:]), flush=True)
        _report(recorder, args, demo_flags, columns, rows, result)  # after every seed: a stopped run keeps its rows
    if not results:
        sys.exit(f"no demo logs for seeds {args.seeds} under {args.logs}")
    print(writer.markdown_table(columns, rows))
    recorder.close()
    print(result)


def _report(
    recorder: writer.Recorder,
    args: argparse.Namespace,
    demo_flags: list[str],
    columns: list[str],
    rows: list[list[object]],
    result: str,
) -> None:
    flags = " ".join(demo_flags)
    variant = args.variant or f"r{args.rounds}-t{args.traffic}-b{args.between}" + (
        "-" + "".join(ch if ch.isalnum() or ch in "._" else "-" for ch in flags.strip("-")).lower()[:40]
        if flags
        else ""
    )
    recorder.write(
        variant,
        title=f"{args.rounds} rounds, {args.traffic} + {args.between} requests per phase, seeds "
        f"{' '.join(str(row[0]) for row in rows)}" + (f", demo flags `{flags}`" if flags else ""),
        columns=columns,
        rows=rows,
        result=result,
        notes=[
            "accuracy: greedy, 48 fresh prompts, the users' own check, of the model served after each round",
            "worse promotion: a promoted challenger with a lower users' live rate than the side it replaced",
            "the canary column's rates: thumbs-up where every answer is rated; right by the users' own check where few "
            "are (--rating-rate below 1)",
        ],
    )


if __name__ == "__main__":
    main()
