"""The benchmarks' shared report writer: each benchmark writes what it measured, with the command, the
machine and the load it ran under, as one section of its page in ``docs/benchmarks/``.

A page holds hand-written prose (what is measured, the target, what the figures mean) and one
section per variant (a model shape, a workload, a device), each between the markers
``<!-- bench:VARIANT -->`` and ``<!-- /bench:VARIANT -->``. Writing a variant replaces its section
and leaves the prose and the other sections alone; a new variant is appended to the page (a page
that does not exist yet is created with a title). So the docs site shows the figures of the last
run of each variant exactly as the benchmark printed them, and a rerun is one command.

Use, in a benchmark's ``main()``::

    writer.add_arguments(parser)                  # --report-dir, --no-report
    args = parser.parse_args()
    recorder = writer.Recorder("ingest", args)    # starts sampling the load average
    ...                                           # the measurement
    recorder.write("tansu", title="...", columns=[...], rows=[[...]], result="durable/raw: 0.946")

The load is the 1-minute load average (``os.getloadavg``), read when the recorder starts, every
``LOAD_SAMPLE_S`` seconds while it runs and when it writes: a ratio measured side by side is fair
to both sides, but a loaded host makes the absolute times meaningless, and the page says so.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / "docs" / "benchmarks"
LOAD_SAMPLE_S = 5.0
_VARIANT = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--report-dir`` and ``--no-report`` to a benchmark's command line."""
    parser.add_argument(
        "--report-dir",
        type=Path,
        default=DEFAULT_DIR,
        help="Folder of the benchmark pages this run writes its section into (default: docs/benchmarks).",
    )
    parser.add_argument("--no-report", action="store_true", help="Print only; write no benchmark page.")


def cpu_flags() -> list[str]:
    """The bf16 matrix features of this CPU (``amx_*``, ``avx512_bf16``) as ``/proc/cpuinfo`` lists them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted(set(re.findall(r"\b(amx_[a-z0-9_]+|avx512_bf16)\b", text)))


def machine() -> str:
    """One line: CPU model, cores this process may use, bf16 features, memory, and the GPUs torch sees."""
    model = platform.processor() or platform.machine()
    memory = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), model)
        kib = int(
            next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        )
        memory = f", {kib / 2**20:.0f} GiB memory"
    except (OSError, StopIteration, ValueError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = cpu_flags()
    line = f"{model}, {cores} cores ({', '.join(flags) if flags else 'no AMX, no AVX512-BF16'}){memory}"
    torch = sys.modules.get("torch")  # only when the benchmark imported it: never import torch for this
    if torch is not None and torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        line += f"; GPU: {', '.join(names)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return line


def commit() -> str:
    """Short commit of the checkout, with ``+changes`` when tracked files differ from it; ``unknown`` outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def command() -> str:
    """The command line that ran, as ``python bench/NAME.py ARGS`` from the repository root
    (without ``--report-dir``, which changes where the page goes, not what is measured)."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(REPO))
    except ValueError:
        shown = str(script)
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--report-dir":
            skip = True
        elif not arg.startswith("--report-dir="):
            args.append(arg)
    return shlex.join(["python", shown, *args])


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-style table; ``|`` inside a cell is escaped, every row must have one cell per column.

    Raises:
        ValueError: a row with another number of cells than ``columns``.
    """
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells for {len(columns)} columns")

    def cell(value: object) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def section(
    variant: str,
    *,
    title: str,
    command_line: str,
    machine_line: str,
    load: str,
    when: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    result: str,
    notes: Sequence[str] = (),
) -> str:
    """The markdown of one variant's section, markers included (what :meth:`Recorder.write` writes)."""
    body = [
        f"<!-- bench:{variant} -->",
        f"### {title} {{#{variant}}}",  # the variant is the anchor: pages link to benchmarks/<page>.md#<variant>
        "",
        "```bash",
        command_line,
        "```",
        "",
        f"Machine: {machine_line}. Load (1-minute average): {load}. Run: {when}.",
        "",
        markdown_table(columns, rows),
        "",
        f"**Result:** {result}",
    ]
    if notes:
        body += [""] + [f"- {note}" for note in notes]
    body.append(f"<!-- /bench:{variant} -->")
    return "\n".join(body) + "\n"


def replace_section(page: str, variant: str, text: str) -> str:
    """``page`` with the section of ``variant`` replaced by ``text`` (appended when the page has none)."""
    start, end = f"<!-- bench:{variant} -->", f"<!-- /bench:{variant} -->"
    if start in page:
        head, _, rest = page.partition(start)
        if end not in rest:
            raise ValueError(f"section {variant!r} has no end marker {end!r}")
        _, _, tail = rest.partition(end)
        return head + text.rstrip("\n") + tail
    return page.rstrip("\n") + "\n\n" + text


class Recorder:
    """Samples the load while a benchmark runs and writes its sections into ``<report_dir>/<page>.md``."""

    def __init__(self, page: str, args: argparse.Namespace | None = None) -> None:
        if not _VARIANT.match(page):
            raise ValueError(f"page name {page!r} must match {_VARIANT.pattern}")
        self.page = page
        self.enabled = not getattr(args, "no_report", False)
        self.report_dir = Path(getattr(args, "report_dir", DEFAULT_DIR))
        self.started = dt.datetime.now(dt.timezone.utc)
        self.loads = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="bench-load", daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(LOAD_SAMPLE_S):
            self.loads.append(os.getloadavg()[0])

    def load(self) -> str:
        """``"1.8 at the start, 1.4 at the end, 2.3 at most"`` (1-minute load averages)."""
        now = os.getloadavg()[0]
        return f"{self.loads[0]:.1f} at the start, {now:.1f} at the end, {max(self.loads + [now]):.1f} at most"

    def write(
        self,
        variant: str,
        *,
        title: str,
        columns: Sequence[str],
        rows: Sequence[Sequence[object]],
        result: str,
        notes: Sequence[str] = (),
    ) -> Path | None:
        """Write (or replace) the section ``variant`` of this benchmark's page; None with ``--no-report``.

        Raises:
            ValueError: a variant name that is not a slug, or a row of the wrong width.
        """
        if not _VARIANT.match(variant):
            raise ValueError(f"variant {variant!r} must match {_VARIANT.pattern}")
        when = f"{self.started:%Y-%m-%d %H:%M} UTC, {_duration((dt.datetime.now(dt.timezone.utc) - self.started).total_seconds())}, commit {commit()}"
        text = section(
            variant,
            title=title,
            command_line=command(),
            machine_line=machine(),
            load=self.load(),
            when=when,
            columns=columns,
            rows=rows,
            result=result,
            notes=notes,
        )
        if not self.enabled:
            return None
        self.report_dir.mkdir(parents=True, exist_ok=True)
        path = self.report_dir / f"{self.page}.md"
        page = path.read_text() if path.exists() else f"# {self.page}\n"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(replace_section(page, variant, text))
        tmp.replace(path)  # a reader never sees half a page
        print(f"report: wrote section {variant!r} of {path}", file=sys.stderr)  # stdout's last line stays the ratio
        return path

    def close(self) -> None:
        """Stop sampling the load (also done at exit: the sampler is a daemon thread)."""
        self._stop.set()


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
