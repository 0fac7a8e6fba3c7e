"""K candidate experiments two ways, side by side in one run.

(a) traditional: one fresh process per experiment; each loads the base and
    starts its own vLLM server, trains one LoRA candidate, evaluates, exits.
    Experiments run one after another (this machine has 2 cores).
(b) hourglass: one process, one resident base with all K adapters (offload
    store), one shared vLLM server that samples for every adapter at once.

Identical work both ways: per candidate S GRPO steps of P prompts x G
rollouts, then greedy evaluation on the same held-out prompts. The task is
the demo's (one-digit additions, ``pipeline/demo/traffic.py``), the reward the
demo's users' own check (``first_number_answer``, which the base gets right
now and then) plus ``format`` at weight 0.5, the K candidates a small
learning-rate sweep (2.5e-4 .. 2e-3, rank 8); evaluation scores the greedy
answers with ``first_number_answer``, so both sides print what was learned:
the base's evaluation reward, each candidate's after training (the same
candidate on both sides: same seeds, same prompts, same start weights) and
the mean training reward of the first and last step.

Workloads (``--workload``): ``default`` (S=2, P=2, G=4, 16 new tokens) and
``round`` (the demo's per-round budget, deploy/demo.toml [rl]: S=3, P=4, G=6,
12 new tokens); both evaluate on 32 held-out prompts. ``both`` runs one after
the other in one invocation. Flags given explicitly override the preset.

Per workload it prints wall clock and peak memory (RSS of the process tree,
trainer + vLLM, sampled every 0.2 s) of both sides, the swap time as a
fraction of update time, rollout tokens/s with K adapters in one engine vs
one adapter at a time, the round's phase breakdown (``time/*_s`` round
metrics, trainer/timers.py; (a) summed over its processes), the learning
lines, the speedup (a)/(b), and the update time of the K candidates'
training step sequential (rows whole, and each prompt once) vs one-pass
(``rl.update.mode``, bench/one_pass.py: same process, same base in the dtype
``model.dtype = auto`` picks, same rows of the workload's size, alternating).
The last lines repeat the speedups.
(b) trains in ``--update-mode`` (default ``one_pass``); (a) has one candidate
per process and trains ``sequential``, as a lone experiment would.

    python bench/multilora.py --k 2 --steps 1 --eval-prompts 8 --ratio-repeats 1   # a check that it runs (62 min at load 13-55)
    python bench/multilora.py                         # K=8, SmolLM2, default workload
    python bench/multilora.py --workload both         # both presets in one run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import writer
from pipeline.stack import free_port, vllm_service
from trainer.model import store as model_store
from trainer.config import (
    AdapterStoreKind,
    CandidateConfig,
    GateConfig,
    ModelConfig,
    RewardTerm,
    RLConfig,
    RolloutConfig,
    UpdateConfig,
    UpdateMode,
)
from trainer.timers import PHASES

# Per-experiment budgets; "round" is deploy/demo.toml's [rl] and [rl.rollout] (steps_per_round, prompts_per_step, group_size, max_new_tokens).
WORKLOADS = {
    "default": {"steps": 2, "prompts": 2, "group": 4, "max_new_tokens": 16, "eval_prompts": 32},
    "round": {"steps": 3, "prompts": 4, "group": 6, "max_new_tokens": 12, "eval_prompts": 32},
}
LEARNING_RATES = (2.5e-4, 5e-4, 1e-3, 2e-3)
EVAL_REWARD = [RewardTerm(fn="first_number_answer")]


class PeakRSS:
    """Peak summed RSS (bytes) of a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.root = psutil.Process(pid)
        self.every_s = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        total = 0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            time.sleep(self.every_s)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def candidates(k: int) -> list[CandidateConfig]:
    """K GRPO candidates: the demo's reward plus brevity, rank 8, learning rates cycling over LEARNING_RATES."""
    mix = [RewardTerm(fn="first_number_answer", weight=1.0), RewardTerm(fn="format", weight=0.5)]
    return [
        CandidateConfig(
            name=f"c{i}",
            learning_rate=LEARNING_RATES[i % len(LEARNING_RATES)],
            lora_rank=8,
            lora_alpha=16,
            kl_coef=0.01,
            reward=mix,
            start="fresh",
        )
        for i in range(k)
    ]


def rl_config(args: argparse.Namespace, update_mode: UpdateMode) -> RLConfig:
    return RLConfig(
        steps_per_round=args.steps,
        prompts_per_step=args.prompts,
        rollout=RolloutConfig(group_size=args.group, max_new_tokens=args.max_new_tokens),
        gate=GateConfig(eval_prompts=args.eval_prompts, reward=EVAL_REWARD, max_kl=100.0),
        adapter_store=AdapterStoreKind.OFFLOAD,
        seed=0,
        update=UpdateConfig(mode=update_mode),
    )


def tables(args: argparse.Namespace):
    """Train and held-out snapshot tables of the demo's task (pipeline/demo/traffic.py arithmetic_questions: one-digit
    additions), enough held-out rows for ``--eval-prompts``."""
    from trainer.tasks import reasoning_gym_prompts
    from trainer.data import snapshot_table, split_snapshot

    n = max(48, 4 * args.eval_prompts + 8)
    prompts = reasoning_gym_prompts(
        "basic_arithmetic",
        n,
        seed=0,
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=1,
        operators=("+",),
        allow_parentheses=False,
        allow_negation=False,
    )
    return split_snapshot(snapshot_table(prompts), 0.25)


def start_vllm(model: Path, logs: Path, max_loras: int):
    service = vllm_service(
        model,
        "127.0.0.1",
        free_port(),
        logs,
        max_model_len=512,
        kv_cache_gib=1,
        max_lora_rank=16,
        max_loras=max_loras,
        startup_timeout_s=900,  # generous: a loaded 2-core host can take minutes to import vLLM
    )
    service.start()
    return service


def run_round_with_vllm(
    model: Path,
    cands: list[CandidateConfig],
    args: argparse.Namespace,
    update_mode: UpdateMode,
    out: Path,
    extra=None,
) -> dict:
    """Start a vLLM server, run one round, optionally measure rollout throughput, stop the server."""
    from trainer.rollout.vllm import VLLMEngine
    from trainer.data import round_inputs
    from trainer.round import RoundParts, run_round
    from trainer.types import RoundSpec

    train, heldout = tables(args)
    started = time.perf_counter()
    service = start_vllm(model, out / "logs", max_loras=max(2, len(cands)))
    startup_s = time.perf_counter() - started
    try:
        engine = VLLMEngine(f"http://127.0.0.1:{service.port}")
        rl = rl_config(args, update_mode)
        result = run_round(
            RoundSpec(ModelConfig(name=str(model)), tuple(cands), rl),
            round_inputs(train, heldout),
            out / "round",
            parts=RoundParts(engine=engine),
        )
        metrics = [m for c in result.candidates for m in c.step_metrics]
        tenant = cands[0].served_model
        report = {
            "vllm_startup_s": startup_s,
            "swap_s": sum(m["train/swap_s"] for m in metrics),
            "update_s": sum(m["train/update_s"] for m in metrics),
            "eval_base": result.metrics.get(f"eval/verifiable/champion/{tenant}", float("nan")),
            "eval_reward": {c.name: c.eval_metrics.get("eval/reward_mean", float("nan")) for c in result.candidates},
            "train_reward": {c.name: [m["train/reward_mean"] for m in c.step_metrics] for c in result.candidates},
            "phases": {k: result.metrics.get(k, 0.0) for k in PHASES},
        }
        if extra is not None:
            extra_started = time.perf_counter()
            report |= extra(engine, result)
            report["extra_s"] = time.perf_counter() - extra_started
        return report
    finally:
        service.stop()


def rollout_throughput(engine, result, args: argparse.Namespace) -> dict:
    """Tokens/s sampling K adapters in one engine call vs one adapter per call (same requests)."""
    from transformers import AutoTokenizer

    from trainer.model.base import chat_token_ids
    from trainer.rollout.engine import RolloutRequest
    from trainer.data import prompts_from_table

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    train, _ = tables(args)

    prompts = prompts_from_table(train)[: args.prompts]
    ids = [tuple(chat_token_ids(tok, p.messages)) for p in prompts]
    versions = []
    for c in result.candidates:
        engine.load(c.name, f"bench-{c.name}", c.adapter_dir)
        versions.append(f"bench-{c.name}")

    def reqs(vs: list[str]) -> list[RolloutRequest]:
        return [
            RolloutRequest(
                version=v,
                prompt_id=p.prompt_id,
                prompt_token_ids=i,
                n=args.group,
                max_new_tokens=args.max_new_tokens,
                seed=1,
            )
            for v in vs
            for p, i in zip(prompts, ids)
        ]

    started = time.perf_counter()
    groups = engine.generate(reqs(versions))
    together_s = time.perf_counter() - started
    together_tokens = sum(len(s.token_ids) for g in groups for s in g)
    started = time.perf_counter()
    one_tokens = 0
    for v in versions:
        one_tokens += sum(len(s.token_ids) for g in engine.generate(reqs([v])) for s in g)
    one_s = time.perf_counter() - started
    for v in versions:
        engine.unload(v)
    return {"rollout_together_tok_s": together_tokens / together_s, "rollout_one_at_a_time_tok_s": one_tokens / one_s}


def update_ratio(args: argparse.Namespace, name: str) -> list[str]:
    """Sequential vs one-pass update time of K candidates on the workload's rows (bench/one_pass.py);
    also written as the section ``multilora-<workload>`` of the one-pass benchmark page."""
    from bench.one_pass import COLUMNS, compare_modes, make_batches, report, table_rows
    from trainer.model.base import load_base
    from trainer.data import prompts_from_table

    base = load_base(ModelConfig(name=args.model_dir))  # dtype "auto": bf16 where the hardware has it
    train, _ = tables(args)
    prompts = [base.chat_token_ids(p.messages) for p in prompts_from_table(train)[: args.prompts]]
    batches = make_batches(base, prompts, args.k, args.group, args.max_new_tokens)
    rl = rl_config(args, UpdateMode.SEQUENTIAL)
    rl = rl.model_copy(update={"update": rl.update.model_copy(update={"adapters_per_pass": args.k})})
    result = compare_modes(base, candidates(args.k), batches, rl, args.ratio_repeats)
    dtype = next(base.model.parameters()).dtype
    lines = report(result, args.k)
    lines[0] = f"{lines[0]}; base {dtype}, {args.prompts * args.group} rows per candidate"
    args.one_pass_recorder.write(
        f"multilora-{name}",
        title=f"workload `{name}` of bench/multilora.py: K = {args.k}, {dtype} base, {args.prompts * args.group} rows "
        f"per candidate ({args.prompts} prompts x G = {args.group}, {args.max_new_tokens} new tokens)",
        columns=COLUMNS,
        rows=table_rows(result),
        result=lines[-1],
        notes=[f"median of {args.ratio_repeats} alternating steps, inside the `bench/multilora.py` run above"],
    )
    return lines


def phases(reports: list[dict[str, float]]) -> str:
    """``rollout 12.3 s, reference 1.0 s, ...``: phase times summed over reports."""
    return ", ".join(
        f"{k.removeprefix('time/').removesuffix('_s')} {sum(r.get(k, 0.0) for r in reports):.1f} s" for k in PHASES
    )


def learning(reports_a: list[dict], report_b: dict, eval_prompts: int) -> list[str]:
    """What both sides learned: base and per-candidate evaluation reward, first- and last-step training reward."""
    after_a = {n: v for r in reports_a for n, v in r["eval_reward"].items()}
    after_b = report_b["eval_reward"]
    train_a = {n: v for r in reports_a for n, v in r["train_reward"].items()}
    train_b = report_b["train_reward"]
    base_a = statistics.fmean(r["eval_base"] for r in reports_a)

    def mean(values) -> float:
        return statistics.fmean(values) if values else float("nan")

    def fmt(d: dict[str, float]) -> str:
        return "[" + ", ".join(f"{d[n]:.3f}" for n in sorted(d, key=lambda n: int(n[1:]))) + "]"

    gap = max((abs(after_a[n] - after_b[n]) for n in after_b if n in after_a), default=float("nan"))
    return [
        f"eval reward (first_number_answer of greedy answers, {eval_prompts} held-out prompts): base {base_a:.3f} (a) / "
        f"{report_b['eval_base']:.3f} (b); after training (a) mean {mean(list(after_a.values())):.3f} {fmt(after_a)}, "
        f"(b) mean {mean(list(after_b.values())):.3f} {fmt(after_b)}; largest per-candidate |a - b| {gap:.3f}",
        f"train reward (first_number_answer + 0.5 format), mean over candidates, first step -> last step: "
        f"(a) {mean([v[0] for v in train_a.values()]):.3f} -> {mean([v[-1] for v in train_a.values()]):.3f}, "
        f"(b) {mean([v[0] for v in train_b.values()]):.3f} -> {mean([v[-1] for v in train_b.values()]):.3f}",
    ]


def worker(args: argparse.Namespace) -> None:
    """(a) one experiment in its own process; writes a JSON report."""
    cand = candidates(args.k)[args.worker]
    out = Path(args.out) / f"a-{cand.name}"
    report = run_round_with_vllm(Path(args.model_dir), [cand], args, UpdateMode.SEQUENTIAL, out)
    Path(args.report).write_text(json.dumps(report))


def run_workload(name: str, args: argparse.Namespace, out: Path) -> float:
    """(a), (b) and the update ratio of one workload; prints its lines, returns the speedup (a)/(b)."""
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"== workload {name}: K={args.k} steps={args.steps} P={args.prompts} G={args.group} max_new_tokens={args.max_new_tokens} "
        f"eval_prompts={args.eval_prompts}; (b) update_mode={args.update_mode}; model={args.model_dir}",
        flush=True,
    )

    # (a) traditional: K fresh processes, each with its own base and vLLM server
    started = time.perf_counter()
    peak_a, reports = 0, []
    for i in range(args.k):
        report_path = out / f"a-{i}.json"
        argv = [
            sys.executable,
            __file__,
            "--worker",
            str(i),
            "--report",
            str(report_path),
            "--model-dir",
            args.model_dir,
            "--k",
            str(args.k),
            "--steps",
            str(args.steps),
            "--prompts",
            str(args.prompts),
            "--group",
            str(args.group),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--eval-prompts",
            str(args.eval_prompts),
            "--out",
            str(out),
        ]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=(out / f"a-{i}.log").open("wb"))
        with PeakRSS(proc.pid) as mem:
            if proc.wait() != 0:
                raise SystemExit(f"experiment {i} failed; see {out / f'a-{i}.log'}")
        peak_a = max(peak_a, mem.peak)
        reports.append(json.loads(report_path.read_text()))
    wall_a = time.perf_counter() - started
    print(
        f"(a) traditional: {args.k} processes, wall {wall_a:.1f} s, peak RSS {peak_a / 2**30:.2f} GiB, "
        f"vLLM startup total {sum(r['vllm_startup_s'] for r in reports):.1f} s",
        flush=True,
    )

    # (b) one resident base, K adapters, one shared vLLM engine
    started = time.perf_counter()
    with PeakRSS(os.getpid()) as mem:
        report_b = run_round_with_vllm(
            Path(args.model_dir),
            candidates(args.k),
            args,
            UpdateMode(args.update_mode),
            out / "b",
            extra=lambda e, r: rollout_throughput(e, r, args),
        )
    # The rollout throughput probe runs after the round; it is not part of (b)'s work.
    wall_b = time.perf_counter() - started - report_b["extra_s"]
    print(
        f"(b) resident base + shared vLLM: 1 process, wall {wall_b:.1f} s, peak RSS {mem.peak / 2**30:.2f} GiB, "
        f"vLLM startup {report_b['vllm_startup_s']:.1f} s"
    )
    print(
        f"swap time / update time in (b): {report_b['swap_s']:.3f} s / {report_b['update_s']:.1f} s = "
        f"{report_b['swap_s'] / max(report_b['update_s'], 1e-9):.2%}"
    )
    together, one = report_b["rollout_together_tok_s"], report_b["rollout_one_at_a_time_tok_s"]
    print(
        f"rollout tokens/s, {args.k} adapters in one engine call: {together:.1f}; one adapter at a time: {one:.1f}; ratio {together / one:.2f}x"
    )
    print(f"phases (a), summed: {phases([r['phases'] for r in reports])}")
    print(f"phases (b): {phases([report_b['phases']])}")
    learned = learning(reports, report_b, args.eval_prompts)
    print("\n".join(learned))
    print(f"speedup (a)/(b) [{name}]: {wall_a / wall_b:.2f}x", flush=True)
    startup_a = sum(r["vllm_startup_s"] for r in reports)
    phase_a = {k: sum(r["phases"].get(k, 0.0) for r in reports) for k in PHASES}
    rows = [
        ["wall time", f"{wall_a:.1f} s", f"{wall_b:.1f} s", f"**{wall_a / wall_b:.2f}x**"],
        ["vLLM start-ups", f"{startup_a:.1f} s", f"{report_b['vllm_startup_s']:.1f} s", ""],
        ["peak RSS (process tree)", f"{peak_a / 2**30:.2f} GiB", f"{mem.peak / 2**30:.2f} GiB", ""],
    ]
    for key in PHASES:
        a, b = phase_a[key], report_b["phases"].get(key, 0.0)
        rows.append([f"phase `{key}`", f"{a:.1f} s", f"{b:.1f} s", f"{a / b:.2f}x" if b > 0 else ""])
    args.recorder.write(
        name,
        title=f"workload `{name}`: K = {args.k} GRPO candidates, {args.steps} steps of {args.prompts} prompts x "
        f"G = {args.group}, {args.max_new_tokens} new tokens, {args.eval_prompts} held-out prompts; (b) in "
        f"`{args.update_mode}` mode",
        columns=["", "(a) one process + vLLM per experiment", "(b) one resident base + shared vLLM", "(a) / (b)"],
        rows=rows,
        result=f"speedup (a) / (b) at workload `{name}`: **{wall_a / wall_b:.2f}x**",
        notes=[
            f"rollout tokens/s with {args.k} adapters in one engine call: {together:.1f}; one adapter at a time: "
            f"{one:.1f} ({together / one:.2f}x)",
            f"swap time / update time in (b): {report_b['swap_s']:.3f} s / {report_b['update_s']:.1f} s",
            *learned,
        ],
    )
    if args.update_ratio:
        print("\n".join(update_ratio(args, name)), flush=True)
    return wall_a / wall_b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workload", choices=[*WORKLOADS, "both"], default="default", help="per-experiment budget preset(s)"
    )
    parser.add_argument("--k", type=int, default=8, help="candidate experiments")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per candidate (default: the preset's)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the preset's)")
    parser.add_argument("--group", type=int, default=None, help="rollouts per prompt G (default: the preset's)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the preset's")
    parser.add_argument(
        "--eval-prompts", type=int, default=None, help="held-out prompts evaluated (default: the preset's)"
    )
    parser.add_argument(
        "--update-mode", choices=["sequential", "one_pass"], default="one_pass", help="rl.update.mode of (b)'s round"
    )
    parser.add_argument(
        "--update-ratio",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the K candidates' update step sequential vs one-pass",
    )
    parser.add_argument("--ratio-repeats", type=int, default=3, help="timed update steps per mode")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="packaged model key or folder")
    parser.add_argument("--out", default=None, help="work folder (default: a temp dir)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--report", default=None, help=argparse.SUPPRESS)
    writer.add_arguments(parser)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return
    args.recorder = writer.Recorder("multilora", args)
    args.one_pass_recorder = writer.Recorder("one-pass", args)
    args.model_dir = str(
        model_store.resolve(args.model, ModelConfig().cache_dir)
        if args.model in model_store.KNOWN_MODELS
        else Path(args.model)
    )
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-multilora-"))
    names = list(WORKLOADS) if args.workload == "both" else [args.workload]
    explicit = {k: v for k, v in vars(args).items() if k in WORKLOADS["default"] and v is not None}
    speedups = {}
    for name in names:
        run_args = argparse.Namespace(**(vars(args) | WORKLOADS[name] | explicit))
        run_args.out = str(out / name)
        speedups[name] = run_workload(name, run_args, out / name)
    print(" ".join(f"speedup (a)/(b) at workload {name}: {s:.2f}x;" for name, s in speedups.items()).rstrip(";"))


if __name__ == "__main__":
    main()
