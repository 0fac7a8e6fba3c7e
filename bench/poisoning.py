"""Poisoning resistance, measured (issue #28): the demo's arithmetic scenario with a share of coordinated hostile
users who vote up wrong answers and down right ones, at 0 %, 2 %, 5 % and 10 % of the requests, each share once
as one API key posing as many users (``--hostile-keys one``) and once as a key per hostile user (``many``).

Each run is the demo itself (``python -m pipeline.demo``, a subprocess; one after the other, never two at once:
they share the stack's ports and state), with ``--rounds``, ``--traffic``, ``--between`` and ``--seed`` passed
through. From each run's printed lines (see :func:`parse`) it reads the greedy accuracy of the served model by
round (48 fresh prompts, the users' own check), the reward model's held-out AUC by round (the round's own, over
all held-out votes: hostile ones included, the demo cannot see the reward model's per-row scores) and each
canary's outcome with the honest users' live thumbs-up on both sides. A *worse promotion* is a promoted
challenger whose honest thumbs-up rate (point estimate) is below the replaced side's (champion or base).

Target: at 5 % hostile users the final accuracy is >= 90 % of the clean run's, and no run promotes a worse
model. A run that fails (exit status not 0) is a row of its own and fails the target.

    python bench/poisoning.py [--rounds 4] [--traffic 192] [--between 96] [--seed 0]

One clean run of the default demo takes about 40 min on the 2-core dev host; the whole benchmark (7 runs)
several hours. Each run's full output is kept under ``--logs``; with ``--reuse-logs`` a run whose log there is
complete is read instead of run again, and the page is written after every run.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import writer  # noqa: E402

SHARES = (0.0, 0.02, 0.05, 0.10)
MODES = ("one", "many")
TARGET_SHARE = 0.05
TARGET_RATIO = 0.9

# ASCII digits only (a Unicode digit is no demo output), counts bounded, every pattern anchored at a line start.
_N = r"[0-9]{1,9}"
_ACCURACY = re.compile(r"^greedy accuracy of the served model by round \([0-9]+ fresh prompts\): (.+)$", re.M | re.A)
_ACCURACY_AFTER = re.compile(r"^greedy accuracy after round ([0-9]+) \(.*\): ([0-9.]+)$", re.M | re.A)
_AUC = re.compile(r"^reward model held-out AUC by round: ([-0-9., ]+)", re.M | re.A)
_CANARY = re.compile(
    rf"^canary of round ({_N}), honest users only: challenger v(\S+) ({_N})/({_N}) \(.*?\), "
    rf"replaced side (\S+) ({_N})/({_N}) \(.*?\); (PROMOTED|ABORTED|undecided)$",
    re.M | re.A,
)
_TOTAL = re.compile(rf"^total time ({_N}) s", re.M | re.A)
_LIVE = re.compile(r"^last phase / first phase .*rate: ([0-9.]+)x$", re.M | re.A)
_EXPLICIT_ONLY = re.compile(r"^explicit-only line \(.*?\): greedy accuracy ([0-9.]+)", re.M | re.A)
_FORGETTING = re.compile(r"^regression suite .*; forgetting \(base - champion\) ([-+0-9.]+),", re.M | re.A)
_LOAD = re.compile(rf"^total time {_N} s on {_N} CPUs; load average \(1, 5, 15 min\) ([0-9.]+), ([0-9.]+)", re.M | re.A)


@dataclass(frozen=True)
class Canary:
    """One canary as the demo's honest line tells it: thumbs-up ``up`` of ``rated`` honest votes per side."""

    round: int
    version: str
    challenger: tuple[int, int]  # (up, rated) by honest users
    replaced: str  # "base", "v3", ...: the side the challenger would replace
    control: tuple[int, int]
    outcome: str  # PROMOTED, ABORTED or undecided

    @property
    def worse(self) -> bool:
        """Promoted although the honest users' thumbs-up rate (point estimate) is below the replaced side's;
        a side without honest votes compares as unknown (not worse). A promotion whose line no demo can print
        (more thumbs-up than votes on a side) counts as worse: a garbled line never passes a run."""
        (up, n), (c_up, c_n) = self.challenger, self.control
        if self.outcome != "PROMOTED":
            return False
        return up > n or c_up > c_n or (n > 0 and c_n > 0 and up / n < c_up / c_n)


@dataclass
class Run:
    """What one demo run printed: greedy accuracy and AUC by round (None: the API sent none), the canaries."""

    accuracy: list[float] = field(default_factory=list)
    aucs: list[float | None] = field(default_factory=list)
    canaries: list[Canary] = field(default_factory=list)
    total_s: float | None = None
    live_ratio: float | None = None  # the users' live rate, last phase / first phase
    forgetting: float | None = None  # the shipped regression suite: base - final champion
    load: str | None = None  # the 1/5-min load average the demo printed at its end
    explicit_only: float | None = None  # greedy accuracy of the explicit-only line (same traffic; rating rate < 1)

    @property
    def final(self) -> float | None:
        """Greedy accuracy of the model served after the last round; None when the run printed none."""
        return self.accuracy[-1] if self.accuracy else None


def parse(text: str) -> Run:
    """The figures of one demo run's output (plain text, as the demo prints when its output is not a terminal).

    Reads the scoreboard's ``greedy accuracy of the served model by round`` line (else the per-round ``greedy
    accuracy after round i`` lines, from a run that ended early), ``reward model held-out AUC by round`` and each
    ``canary of round i, honest users only`` line. Missing lines leave their field empty; nothing raises."""
    run = Run()
    if match := _last(_ACCURACY, text):  # the demo prints its scoreboard last: a line before it is not its own
        run.accuracy = _accuracies(match.group(1).split(","))
    else:
        run.accuracy = _accuracies(m.group(2) for m in _ACCURACY_AFTER.finditer(text))
    if match := _last(_AUC, text):
        run.aucs = [_number(x) for x in match.group(1).strip().split(",")]
    for m in _CANARY.finditer(text):
        run.canaries.append(
            Canary(
                round=int(m.group(1)),
                version=m.group(2),
                challenger=(int(m.group(3)), int(m.group(4))),
                replaced=m.group(5),
                control=(int(m.group(6)), int(m.group(7))),
                outcome=m.group(8),
            )
        )
    run.total_s = _number(_group(_last(_TOTAL, text)))
    run.live_ratio = _number(_group(_last(_LIVE, text)))
    run.forgetting = _number(_group(_last(_FORGETTING, text)))
    run.explicit_only = _number(_group(_last(_EXPLICIT_ONLY, text)))
    if match := _last(_LOAD, text):
        one, five = _number(match.group(1)), _number(match.group(2))
        run.load = None if one is None or five is None else f"{match.group(1)} / {match.group(2)}"
    return run


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    """The last match of ``pattern`` in ``text`` (the demo prints its result lines once, at the end)."""
    match = None
    for match in pattern.finditer(text):
        pass
    return match


def _group(match: re.Match[str] | None) -> str:
    return "" if match is None else match.group(1)


def _number(text: str) -> float | None:
    """A finite number written in ASCII, or None ("-", junk, a Unicode digit, NaN or infinite)."""
    if not text.isascii():
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _accuracies(texts: Iterable[str]) -> list[float]:
    """Accuracies by round; none at all when one is not a number in [0, 1] (a line that cannot be the demo's)."""
    values = [_number(t) for t in texts]
    return [v for v in values if v is not None] if all(v is not None and 0 <= v <= 1 for v in values) else []


def run_demo(args: argparse.Namespace, log: Path, *extra: str, seed: int | None = None) -> tuple[int, float, str]:
    """One demo run (``args``' config, rounds, traffic, between and seed, then ``extra`` flags) with its output in
    ``log``: (exit status, wall time in s, 1/5-min load average at its end). ``bench/learning.py`` uses it too."""
    cmd = [sys.executable, "-m", "pipeline.demo", "--config", str(args.config)]
    cmd += ["--rounds", str(args.rounds), "--traffic", str(args.traffic), "--between", str(args.between)]
    cmd += ["--seed", str(args.seed if seed is None else seed), *extra]
    print(f"$ {' '.join(cmd[1:])}  > {log}", flush=True)
    started = time.monotonic()
    with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644), "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=writer.REPO, check=False).returncode
    one, five, _ = os.getloadavg()
    return rc, time.monotonic() - started, f"{one:.1f} / {five:.1f}"


def checked_log(log: Path) -> Path:
    """``log`` when it is absent or a regular file; else the benchmark stops with a message (a folder, a link or a
    device in its place would fail half-way, write elsewhere or read forever)."""
    if log.is_symlink() or (log.exists() and not log.is_file()):
        sys.exit(f"{log} is not a regular file (a link, a folder or a device): move it away or choose another --logs")
    return log


def logs_dir(folder: Path) -> Path:
    """``folder``, created if absent; the benchmark stops with a message when it is not a folder or cannot be made."""
    try:
        if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
            sys.exit(
                f"--logs {folder} is not a folder (a file, a link to none, a fifo or a device): choose another --logs"
            )
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file or a broken link above it, no permission, a name too long
        sys.exit(f"--logs {folder} cannot be created ({err.strerror or err}): choose another --logs")
    return folder


def read_log(log: Path) -> Run:
    """The figures of a demo log (:func:`parse`); bytes that are not UTF-8 read as replacement characters."""
    return parse(log.read_text(errors="replace"))


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def table(results: list[tuple[float, str, int, Run, float, str]]) -> tuple[list[str], list[list[object]], str]:
    """The columns, rows and result line of ``results`` (share, mode, exit status, run, wall s, load)."""
    clean = next((r.final for share, _, rc, r, _, _ in results if share == 0.0 and rc == 0), None)
    columns = [
        "hostile share",
        "keys",
        "final greedy accuracy",
        "ratio to clean",
        "accuracy by round",
        "AUC by round (hostile votes included)",
        "promotions",
        "worse promotions",
        "wall",
        "load 1/5 min",
    ]
    rows: list[list[object]] = []
    verdicts: list[bool] = []
    for share, mode, rc, run, wall_s, load in results:
        ratio = run.final / clean if run.final is not None and clean else None
        worse = sum(c.worse for c in run.canaries)
        promoted = sum(c.outcome == "PROMOTED" for c in run.canaries)
        rows.append(
            [
                f"{share:.0%}",
                "-" if share == 0.0 else mode,
                fmt(run.final) if rc == 0 else f"failed (exit {rc})",
                fmt(ratio, ".2f"),
                ", ".join(fmt(a) for a in run.accuracy) or "-",
                ", ".join(fmt(a) for a in run.aucs) or "-",
                promoted,
                worse,
                f"{wall_s / 60:.1f} min",
                load,
            ]
        )
        verdicts.append(rc == 0 and worse == 0)
        if share == TARGET_SHARE and clean is not None:
            verdicts.append(ratio is not None and ratio >= TARGET_RATIO)
    # The accuracy target needs a clean run and a run at the target share: without them no PASS.
    judged = clean is not None and any(share == TARGET_SHARE for share, *_ in results)
    ok = bool(verdicts) and all(verdicts)
    at_target = [
        f"{mode} {fmt(r.final / clean if r.final is not None and clean else None, '.2f')}"
        for share, mode, _, r, _, _ in results
        if share == TARGET_SHARE
    ]
    worse_total = sum(sum(c.worse for c in run.canaries) for _, _, _, run, _, _ in results)
    result = (
        f"at {TARGET_SHARE:.0%} hostile users final accuracy / clean: {', '.join(at_target) or '-'} "
        f"(target >= {TARGET_RATIO:g}); worse promotions in all runs: {worse_total} (target 0): "
        f"{'FAIL' if not ok else 'PASS' if judged else f'NOT JUDGED (needs a clean run and a {TARGET_SHARE:.0%} run)'}"
    )
    return columns, rows, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("deploy/demo.toml"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--traffic", type=int, default=192)
    parser.add_argument("--between", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shares", type=float, nargs="+", default=list(SHARES), help="hostile shares, 0 included")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="hostile key modes to run")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "hourglass-poisoning")
    parser.add_argument("--variant", default="", help="report section name (default: from the settings)")
    parser.add_argument(
        "--reuse-logs",
        action="store_true",
        help="a run whose log under --logs has the demo's result line and a final accuracy is read, not run again "
        "(its wall time and load as the demo printed them): resumes a stopped benchmark, or takes the clean run from "
        "bench/learning.py's log of the same seed copied to demo-0-one.txt. The log is taken as it is: it must come "
        "from the same config, rounds, traffic and environment",
    )
    writer.add_arguments(parser)
    args = parser.parse_args()
    recorder = writer.Recorder("poisoning", args)
    logs_dir(args.logs)
    results: list[tuple[float, str, int, Run, float, str]] = []
    runs = [  # the clean run once; every log path checked before the first run
        (share, mode, checked_log(args.logs / f"demo-{share:g}-{mode}.txt"))
        for share in args.shares
        for mode in (args.modes if share > 0 else args.modes[:1])
    ]
    for share, mode, log in runs:
        kept = read_log(log) if args.reuse_logs and log.is_file() else None
        if kept is not None and kept.total_s is not None and kept.final is not None:
            print(f"{log}: kept from an earlier run", flush=True)
            results.append((share, mode, 0, kept, kept.total_s, kept.load or "-"))
        else:
            rc, wall_s, load = run_demo(args, log, "--hostile-share", str(share), "--hostile-keys", mode)
            results.append((share, mode, rc, read_log(log), wall_s, load))
        columns, rows, result = table(results)
        print(writer.markdown_table(columns, rows[-1:]), flush=True)
        _report(recorder, args, columns, rows, result)  # after every run: a stopped benchmark keeps its rows
    print(writer.markdown_table(columns, rows))
    recorder.close()
    print(result)


def _report(
    recorder: writer.Recorder, args: argparse.Namespace, columns: list[str], rows: list[list[object]], result: str
) -> None:
    recorder.write(
        args.variant or f"r{args.rounds}-t{args.traffic}-b{args.between}-s{args.seed}",
        title=f"{args.rounds} rounds, {args.traffic} + {args.between} requests per phase, seed {args.seed}",
        columns=columns,
        rows=rows,
        result=result,
        notes=[
            "accuracy: greedy, 48 fresh prompts, the users' own check, of the model served after each round",
            "worse promotion: a promoted challenger with a lower honest thumbs-up rate than the side it replaced",
        ],
    )


if __name__ == "__main__":
    main()
