"""K candidate experiments three ways, side by side in one run: what users run instead, and Hourglass.

TRL  the peer: Hugging Face TRL's ``GRPOTrainer`` with a PEFT ``LoraConfig``, one process per
     experiment, no server (TRL's transformers-``generate`` path), one after another
     (bench/peer_trl.py, bench/trl_grpo.py; TRL 1.16 in a scratch venv the benchmark builds once under
     the ignored ``.bench/``, bench/trl_env.py: it never enters the locked runtime).
(a)  traditional Hourglass: one fresh process per experiment; each loads the base and starts its own
     vLLM server, trains one LoRA candidate, evaluates, exits. One after another (2 cores).
(b)  Hourglass: one process, one resident base with all K adapters (offload store), one shared vLLM
     server that samples for every adapter at once.

Identical work on every side: per candidate S GRPO steps of P prompts x G rollouts, then greedy
evaluation on the same held-out prompts. SmolLM2-135M-Instruct, bf16 base (``model.dtype = auto`` on
a CPU with bf16), float32 LoRA r=8 alpha=16 on q/k/v/o, the same start weights (seeded by name and
``--seed``); the demo's task (one-digit additions, ``pipeline/demo/traffic.py``), the step's prompts
drawn by the round's own ``draw_prompts`` in the same order; reward the demo's users' check
(``first_number_answer``) + 0.5 ``format`` (the TRL process imports our reward functions: the same
code); PPO-clip epsilon 0.2, token-mean loss, beta = 0.01 k3 KL to the adapters-off base, AdamW with a
constant learning rate, no weight decay, grad-norm clip 1.0; the K candidates a learning-rate sweep
(2.5e-4 .. 2e-3); evaluation scores greedy answers with ``first_number_answer``.

Settings that cannot match the peer (details in bench/trl_grpo.py and docs/benchmarks/multilora.md):
TRL's advantages divide by the group's *sample* std (+1e-4; ours: population std +1e-6, so TRL's are
ours x sqrt((G-1)/G)); without vLLM TRL's importance ratio is exactly 1 (its "old" log-probs are its
own, detached) so its clip never acts, while ours compares the bf16 trainer with the float32 vLLM
that sampled; TRL samples with ``generate`` in bf16 with its own RNG, ours with float32 vLLM and
per-request seeds; TRL evaluates with bf16 ``generate``, ours with float32 vLLM; TRL runs every row
whole (no prompt sharing, no one-pass update).

Workloads (``--workload``): ``default`` (S=2, P=2, G=4, 16 new tokens, 32 held-out prompts),
``round`` (the demo's per-round budget, deploy/demo.toml [rl]: S=3, P=4, G=6, 12 new tokens, 32
held-out prompts) and ``learn`` (6 steps, 96 held-out prompts: for comparing what the sides learn; on a quiet
host (b) gained +0.06 and TRL +0.02 over two seeds, see the docs page). ``both`` runs default then round; ``all`` every preset. Flags
given explicitly override the preset; ``--sides`` picks the sides (``trl,a,b``), ``--seed`` the
round's seed (prompt draw, LoRA init; TRL's sampling RNG) on every side. The vLLM rollouts are not
seeded (``VLLMEngine`` sends no per-request seed: the vLLM 0.32 CPU engine crashes on them), so no two
runs sample alike and one run's learning figures are noise-dominated: compare seeds' means.

Per workload it prints wall clock and peak memory (RSS of the process tree) of every side, TRL's
phases (imports, load, train, evaluate: summed over its processes) and ours (``time/*_s`` round
metrics, trainer/timers.py; (a) summed over its processes), (b)'s phases against this machine's
limits measured in the run (bench/limits.py: rollout and evaluation tokens/s against the larger of
their compute and weight-read times, training FLOP/s against the bf16 and float32 matmul rates), the swap time as a fraction of update
time, rollout tokens/s with K adapters in one engine call vs one at a time, what every side learned
(base -> after, per candidate, and each side minus (b) per candidate, mean +- SE), the speedups
TRL/(b) and (a)/(b), and the K candidates' update time sequential vs one-pass (bench/one_pass.py).
The last two lines repeat TRL/(b) (the headline) and then (a)/(b) for every workload run.
(b) trains in ``--update-mode`` (default ``one_pass``); (a) has one candidate per process and trains
``sequential``, as a lone experiment would.

    python bench/multilora.py --k 2 --steps 1 --eval-prompts 8 --ratio-repeats 1   # a check that it runs
    python bench/multilora.py --workload both         # K=8, SmolLM2, TRL / (a) / (b), default and round
    python bench/multilora.py --workload learn --seed 1 --sides trl,b --no-update-ratio   # learning, seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import limits, peer_trl, writer
from bench.limits import ModelShape
from bench.multilora_report import Learned, RoundWork, learning_lines, limit_lines
from bench.peak_rss import PeakRSS
from pipeline.stack import free_port, vllm_dtype, vllm_service
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

# Per-experiment budgets; "round" is deploy/demo.toml's [rl] (steps_per_round, prompts_per_step, group_size, max_new_tokens).
LEARNING_RATES = (2.5e-4, 5e-4, 1e-3, 2e-3)
WORKLOADS: dict[str, dict[str, Any]] = {
    "default": {"steps": 2, "prompts": 2, "group": 4, "max_new_tokens": 16, "eval_prompts": 32},
    "round": {"steps": 3, "prompts": 4, "group": 6, "max_new_tokens": 12, "eval_prompts": 32},
    # twice the round's steps, three times its held-out prompts: for comparing what the sides learn (two seeds on a
    # quiet host: (b) +0.06, TRL +0.02, so not yet a workload where both learn; docs/benchmarks/multilora.md)
    "learn": {"steps": 6, "prompts": 4, "group": 6, "max_new_tokens": 12, "eval_prompts": 96},
}
for _preset in WORKLOADS.values():
    _preset["learning_rates"] = LEARNING_RATES  # --learning-rates overrides
EVAL_REWARD = [RewardTerm(fn="first_number_answer")]


def candidates(k: int, learning_rates: Sequence[float] = LEARNING_RATES) -> list[CandidateConfig]:
    """K GRPO candidates: the demo's reward plus brevity, rank 8, learning rates cycling over ``learning_rates``."""
    mix = [RewardTerm(fn="first_number_answer", weight=1.0), RewardTerm(fn="format", weight=0.5)]
    return [
        CandidateConfig(
            name=f"c{i}",
            learning_rate=learning_rates[i % len(learning_rates)],
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
        seed=getattr(args, "seed", 0),
        update=UpdateConfig(mode=update_mode),
    )


def tables(args: argparse.Namespace):
    """Train and held-out snapshot tables of the demo's task (pipeline/demo/traffic.py arithmetic_questions: one-digit
    additions), enough held-out rows for ``--eval-prompts``."""
    from trainer.data import snapshot_table, split_snapshot
    from trainer.tasks import reasoning_gym_prompts

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


def eval_parts(metrics: dict[str, float]) -> dict[str, float]:
    """Where a round's evaluate phase went: the engine's greedy answers and the trainer's KL pass (seconds)."""
    return {part: metrics.get(f"eval/{part}_s", float("nan")) for part in ("greedy", "kl_pass")}


def start_vllm(model: Path, logs: Path, max_loras: int, cpu_threads: str = "all", dtype: str = "auto"):
    service = vllm_service(
        model,
        "127.0.0.1",
        free_port(),
        logs,
        max_model_len=512,
        kv_cache_gib=1,
        max_lora_rank=16,
        max_loras=max_loras,
        cpu_threads=cpu_threads,
        dtype=dtype,
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
    steady: bool = False,
) -> dict:
    """Start a vLLM server, run one round, optionally measure rollout throughput, stop the server.

    With ``steady`` it then runs the same round again on the same server with the base kept from the first
    (``rl.keep_base``, :class:`trainer.model.base.KeptBase`): what every round after the first costs in the
    always-on service, whose serving vLLM is already up (``steady_s``, ``steady_phases``).
    With ``args.share_prompts`` False the round's base runs every row whole (no prompt sharing)."""
    from trainer.model.base import KeptBase, load_base
    from trainer.data import round_inputs
    from trainer.round import RoundParts, run_round
    from trainer.types import RoundSpec
    from trainer.rollout.vllm import VLLMEngine

    train, heldout = tables(args)
    started = time.perf_counter()
    service = start_vllm(
        model, out / "logs", max_loras=max(2, len(cands)), cpu_threads=args.vllm_cpu_threads, dtype=args.vllm_dtype
    )
    startup_s = time.perf_counter() - started
    try:
        engine = VLLMEngine(f"http://127.0.0.1:{service.port}")
        rl = rl_config(args, update_mode)
        base = None
        if not getattr(args, "share_prompts", True):
            base = load_base(ModelConfig(name=str(model)))
            base.share_prompts = False
        spec = RoundSpec(ModelConfig(name=str(model)), tuple(cands), rl)
        parts = RoundParts(base=base, engine=engine, kept_base=KeptBase())
        result = run_round(spec, round_inputs(train, heldout), out / "round", parts=parts)
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
            "eval_parts": eval_parts(result.metrics),
            "rollout_tokens": result.metrics.get("rollout/tokens", 0.0),
            "eval_length": {c.name: c.eval_metrics.get("eval/mean_length", float("nan")) for c in result.candidates},
            "clip_frac": {
                c.name: [m.get("train/clip_frac", float("nan")) for m in c.step_metrics] for c in result.candidates
            },
            "kl": {c.name: [m.get("train/kl", float("nan")) for m in c.step_metrics] for c in result.candidates},
        }
        if extra is not None:
            extra_started = time.perf_counter()
            report |= extra(engine, result)
            report["extra_s"] = time.perf_counter() - extra_started
        if steady:
            steady_started = time.perf_counter()
            again = run_round(spec, round_inputs(train, heldout), out / "round-steady", parts=parts)
            report["steady_s"] = time.perf_counter() - steady_started
            report["steady_phases"] = {k: again.metrics.get(k, 0.0) for k in PHASES}
            report["steady_eval_parts"] = eval_parts(again.metrics)
            report["steady_base_reused"] = again.metrics.get("round/base_reused", 0.0)
        return report
    finally:
        service.stop()


def rollout_throughput(engine, result, args: argparse.Namespace) -> dict:
    """Tokens/s sampling K adapters in one engine call vs one adapter per call (same requests)."""
    from transformers import AutoTokenizer

    from trainer.model.base import chat_token_ids
    from trainer.types import RolloutRequest
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
    result = compare_modes(base, candidates(args.k, args.learning_rates), batches, rl, args.ratio_repeats)
    dtype = next(base.model.parameters()).dtype
    lines = report(result, args.k)
    lines[0] = f"{lines[0]}; base {dtype}, {args.prompts * args.group} rows per candidate"
    args.one_pass_recorder.write(
        f"multilora-{variant_name(name, args)}",
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


def worker(args: argparse.Namespace) -> None:
    """(a) one experiment in its own process; writes a JSON report."""
    cand = candidates(args.k, args.learning_rates)[args.worker]
    out = Path(args.out) / f"a-{cand.name}"
    report = run_round_with_vllm(Path(args.model_dir), [cand], args, UpdateMode.SEQUENTIAL, out)
    Path(args.report).write_text(json.dumps(report))


def run_traditional(args: argparse.Namespace, out: Path) -> dict:
    """(a): K fresh processes one after another, each with its own base and vLLM server."""
    started = time.perf_counter()
    peak, reports = 0, []
    for i in range(args.k):
        report_path = out / f"a-{i}.json"
        argv = [sys.executable, __file__, "--worker", str(i), "--report", str(report_path)]
        argv += ["--model-dir", args.model_dir, "--out", str(out), "--seed", str(args.seed)]
        argv += ["--vllm-cpu-threads", args.vllm_cpu_threads, "--vllm-dtype", args.vllm_dtype]
        for flag in ("k", "steps", "prompts", "group", "max_new_tokens", "eval_prompts"):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        argv += ["--learning-rates", ",".join(map(str, args.learning_rates))]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=(out / f"a-{i}.log").open("wb"))
        with PeakRSS(proc.pid) as mem:
            if proc.wait() != 0:
                raise SystemExit(f"experiment {i} failed; see {out / f'a-{i}.log'}")
        peak = max(peak, mem.peak)
        reports.append(json.loads(report_path.read_text()))
    return {"wall_s": time.perf_counter() - started, "peak_rss": peak, "reports": reports}


def run_hourglass(args: argparse.Namespace, out: Path, trl_reports: list[dict] | None = None) -> dict:
    """(b): one process, one resident base with K adapters, one shared vLLM engine (then the rollout probe and,
    given ``trl_reports``, the TRL adapters judged by the round's evaluator (``trl_judged``), neither part of
    (b)'s work nor in its wall time; with ``args.steady`` the steady-state round, timed apart)."""

    def extra(engine, result) -> dict:
        report = rollout_throughput(engine, result, args) if args.rollout_probe else {}
        if trl_reports:
            from transformers import AutoTokenizer

            rl = rl_config(args, args.update_mode)
            cand = candidates(1, args.learning_rates)[0]
            train, heldout = tables(args)
            rows = peer_trl.experiment_spec(cand, rl, train, heldout, args.model_dir, EVAL_REWARD)["eval_rows"]
            tok = AutoTokenizer.from_pretrained(args.model_dir)
            report["trl_judged"] = peer_trl.judge(engine, trl_reports, rows, tok, rl, EVAL_REWARD)
        return report

    started = time.perf_counter()
    with PeakRSS(os.getpid()) as mem:
        report = run_round_with_vllm(
            Path(args.model_dir),
            candidates(args.k, args.learning_rates),
            args,
            args.update_mode,
            out / "b",
            extra=extra if args.rollout_probe or trl_reports else None,
            steady=args.steady,
        )
    return {
        "wall_s": time.perf_counter() - started - report.get("extra_s", 0.0) - report.get("steady_s", 0.0),
        "peak_rss": mem.peak,
        "report": report,
    }


def round_work(args: argparse.Namespace, report_b: dict) -> RoundWork:
    """What (b)'s round computed (for its rates against the limits): prompt lengths of the drawn prompts."""
    from transformers import AutoTokenizer

    from trainer.model.base import chat_token_ids

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    rl = rl_config(args, args.update_mode)
    train, heldout = tables(args)
    spec = peer_trl.experiment_spec(
        candidates(1, args.learning_rates)[0], rl, train, heldout, args.model_dir, EVAL_REWARD
    )
    lengths = [len(chat_token_ids(tok, r["messages"])) for r in spec["train_rows"]]
    cand = candidates(1, args.learning_rates)[0]
    return RoundWork(
        k=args.k,
        steps=args.steps,
        prompts=args.prompts,
        group=args.group,
        eval_prompts=len(spec["eval_rows"]),
        prompt_tokens_mean=statistics.fmean(lengths),
        rollout_tokens=report_b["rollout_tokens"],
        eval_length_mean=statistics.fmean(report_b["eval_length"].values()),
        lora_rank=cand.lora_rank,
        lora_targets=tuple(cand.target_modules),
        share_prompts=args.share_prompts,
    )


def run_workload(name: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """The sides of one workload (TRL, (a), (b)), the limits and the update ratio; prints its lines,
    returns the ratios ``TRL/(b)`` and ``(a)/(b)`` that were measured."""
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"== workload {name}: K={args.k} steps={args.steps} P={args.prompts} G={args.group} "
        f"max_new_tokens={args.max_new_tokens} eval_prompts={args.eval_prompts} seed={args.seed} "
        f"learning_rates={','.join(map(str, args.learning_rates))}; sides {args.sides}; "
        f"(b) update_mode={args.update_mode} share_prompts={args.share_prompts}; model={args.model_dir}",
        flush=True,
    )
    sides: dict[str, dict] = {}
    learned: dict[str, Learned] = {}

    def keep() -> None:  # every side's reports as soon as it has run, for a later look (and a failed report)
        (out / "sides.json").write_text(json.dumps(sides, default=str))

    if "trl" in args.sides:
        rl = rl_config(args, UpdateMode.SEQUENTIAL)
        sides["trl"] = peer_trl.run_side(
            args.model_dir, candidates(args.k, args.learning_rates), rl, tables(args), EVAL_REWARD, out / "trl"
        )
        reports = sides["trl"]["reports"]
        learned["TRL"] = Learned.from_reports(reports)
        keep()
        print(
            f"TRL GRPOTrainer + PEFT ({reports[0]['trl_version']}, transformers generate): {args.k} processes, "
            f"wall {sides['trl']['wall_s']:.1f} s, peak RSS {sides['trl']['peak_rss'] / 2**30:.2f} GiB; "
            f"phases, summed: {peer_trl.phases_line(reports)}",
            flush=True,
        )
    if "a" in args.sides:
        sides["a"] = run_traditional(args, out)
        reports = sides["a"]["reports"]
        learned["(a)"] = Learned.from_reports(reports)
        keep()
        print(
            f"(a) traditional: {args.k} processes, wall {sides['a']['wall_s']:.1f} s, peak RSS "
            f"{sides['a']['peak_rss'] / 2**30:.2f} GiB, vLLM startup total "
            f"{sum(r['vllm_startup_s'] for r in reports):.1f} s; phases, summed: {phases([r['phases'] for r in reports])}",
            flush=True,
        )
    notes: list[str] = [
        f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} (torch's default: one per core), "
        f"vLLM bound to cores `{args.vllm_cpu_threads}`, vLLM --dtype {vllm_dtype(args.vllm_dtype)}"
    ]
    if "b" in args.sides:
        sides["b"] = run_hourglass(args, out, sides["trl"]["reports"] if "trl" in sides else None)
        report_b = sides["b"]["report"]
        learned["(b)"] = Learned.from_reports([report_b])
        if "trl_judged" in report_b:  # TRL's adapters answered by (b)'s evaluator: one judge for both sides
            learned["TRL, (b)'s judge"] = Learned(report_b["eval_base"], report_b["trl_judged"], learned["TRL"].train)
        keep()
        print(
            f"(b) resident base + shared vLLM: 1 process, wall {sides['b']['wall_s']:.1f} s, peak RSS "
            f"{sides['b']['peak_rss'] / 2**30:.2f} GiB, vLLM startup {report_b['vllm_startup_s']:.1f} s; "
            f"phases: {phases([report_b['phases']])}"
        )
        split = [
            f"{label} greedy answers {parts['greedy']:.1f} s, the trainer's KL pass {parts['kl_pass']:.1f} s"
            for label, parts in (("cold:", report_b["eval_parts"]), ("steady:", report_b.get("steady_eval_parts")))
            if parts is not None
        ]
        notes.append(f"(b) evaluate phase, {'; '.join(split)}")
        if "steady_s" in report_b:
            steady = (
                f"(b) steady state, the same round again with the base kept and vLLM up (base reused: "
                f"{bool(report_b['steady_base_reused'])}): wall {report_b['steady_s']:.1f} s; "
                f"phases: {phases([report_b['steady_phases']])}"
            )
            notes.append(steady)  # printed with the other notes below
        notes.append(
            f"swap time / update time in (b): {report_b['swap_s']:.3f} s / {report_b['update_s']:.1f} s = "
            f"{report_b['swap_s'] / max(report_b['update_s'], 1e-9):.2%}"
        )
        clip = [v for vs in report_b["clip_frac"].values() for v in vs]
        notes.append(
            f"(b) PPO-clip fraction of tokens clipped, mean over candidates and steps: {statistics.fmean(clip):.4f}"
        )
        if args.rollout_probe:
            together, one = report_b["rollout_together_tok_s"], report_b["rollout_one_at_a_time_tok_s"]
            notes.append(
                f"rollout tokens/s, {args.k} adapters in one engine call: {together:.1f}; one adapter at a time: "
                f"{one:.1f}; ratio {together / one:.2f}x"
            )
        if args.limits:
            shape = ModelShape.from_config(json.loads((Path(args.model_dir) / "config.json").read_text()))
            notes += limit_lines(
                limits.measure(), shape, round_work(args, report_b), report_b["phases"], engine_dtype(args.vllm_dtype)
            )
    notes += learning_lines(learned, args.eval_prompts)
    print("\n".join(notes))

    ratios: dict[str, float] = {}
    if "b" in sides:
        wall_b = sides["b"]["wall_s"]
        for key, label in (("trl", "TRL/(b)"), ("a", "(a)/(b)")):
            if key in sides:
                ratios[label] = sides[key]["wall_s"] / wall_b
        if "trl" in sides and "steady_s" in sides["b"]["report"]:
            ratios["TRL/(b) steady"] = sides["trl"]["wall_s"] / sides["b"]["report"]["steady_s"]
    for label, ratio in ratios.items():
        print(f"speedup {label} [{name}]: {ratio:.2f}x", flush=True)
    write_section(name, args, sides, ratios, notes)
    if args.update_ratio:
        print("\n".join(update_ratio(args, name)), flush=True)
    return ratios


def engine_dtype(choice: str) -> str:
    """The dtype vLLM computes in for ``--vllm-dtype choice``: its own ``auto`` on a GPU is the checkpoint's, bf16."""
    served = vllm_dtype(choice)
    return "bfloat16" if served == "auto" else served


def variant_name(name: str, args: argparse.Namespace) -> str:
    """The page section of a run: the workload, with ``-k<K>`` unless K = 8 (the targets' K), ``-seed<S>``
    unless seed 0 and ``-vllm-<dtype>`` unless vLLM runs the service's own dtype, so a smaller check, another
    seed or another engine precision never replaces the headline section."""
    return (
        name
        + (f"-k{args.k}" if args.k != 8 else "")
        + (f"-seed{args.seed}" if args.seed != 0 else "")
        + (f"-vllm-{args.vllm_dtype}" if getattr(args, "vllm_dtype", "auto") != "auto" else "")
    )


SIDE_COLUMNS = {
    "trl": "TRL GRPOTrainer + PEFT, process per experiment",
    "a": "(a) process + vLLM per experiment",
    "b": "(b) resident base + shared vLLM",
}


def write_section(name: str, args: argparse.Namespace, sides: dict, ratios: dict[str, float], notes: list[str]) -> None:
    """The workload's section of docs/benchmarks/multilora.md (bench/writer.py)."""
    keys = [k for k in SIDE_COLUMNS if k in sides]
    ratio_labels = list(ratios)

    def ratio_cells(values: dict[str, float]) -> list[str]:
        """Per-phase ratios: (a)/(b) where both ran the phase; none for TRL (its phases are others)."""
        b = values.get("b", 0.0)
        return [f"{values['a'] / b:.2f}x" if label == "(a)/(b)" and b > 0 else "" for label in ratio_labels]

    walls = {k: sides[k]["wall_s"] for k in keys}
    cold = [f"**{r:.2f}x**" if label != "TRL/(b) steady" else "" for label, r in ratios.items()]
    rows = [["wall time", *[f"{walls[k]:.1f} s" for k in keys], *cold]]
    rows.append(
        ["peak RSS (process tree)", *[f"{sides[k]['peak_rss'] / 2**30:.2f} GiB" for k in keys], *[""] * len(ratios)]
    )
    startup = {"trl": "none"}
    if "a" in sides:
        startup["a"] = f"{sum(r['vllm_startup_s'] for r in sides['a']['reports']):.1f} s"
    if "b" in sides:
        startup["b"] = f"{sides['b']['report']['vllm_startup_s']:.1f} s"
    rows.append(["vLLM start-ups", *[startup[k] for k in keys], *[""] * len(ratios)])
    if "b" in sides and "steady_s" in sides["b"]["report"]:
        steady = {"b": f"{sides['b']['report']['steady_s']:.1f} s"}
        steady_ratio = [f"**{r:.2f}x**" if label == "TRL/(b) steady" else "" for label, r in ratios.items()]
        rows.append(["steady-state round (base kept, vLLM up)", *[steady.get(k, "") for k in keys], *steady_ratio])
    if "trl" in sides:
        for phase in peer_trl.TRL_PHASES:
            cells = {"trl": f"{sum(r['phases'][phase] for r in sides['trl']['reports']):.1f} s"}
            rows.append([f"TRL phase `{phase}`", *[cells.get(k, "") for k in keys], *[""] * len(ratios)])
    ours = {k: [r["phases"] for r in sides[k]["reports"]] for k in ("a",) if k in sides}
    if "b" in sides:
        ours["b"] = [sides["b"]["report"]["phases"]]
    if ours:
        for phase in PHASES:
            values = {k: sum(p.get(phase, 0.0) for p in v) for k, v in ours.items()}
            rows.append(
                [f"phase `{phase}`", *[f"{values[k]:.1f} s" if k in values else "" for k in keys], *ratio_cells(values)]
            )
    result = "; ".join(f"speedup {label} at workload `{name}`: **{r:.2f}x**" for label, r in ratios.items())
    args.recorder.write(
        variant_name(name, args),
        title=f"workload `{name}`: K = {args.k} GRPO candidates, {args.steps} steps of {args.prompts} prompts x "
        f"G = {args.group}, {args.max_new_tokens} new tokens, {args.eval_prompts} held-out prompts, seed {args.seed}, "
        f"learning rates {', '.join(f'{r:g}' for r in args.learning_rates)}; (b) in `{args.update_mode}` mode"
        + (f", vLLM --dtype {args.vllm_dtype}" if getattr(args, "vllm_dtype", "auto") != "auto" else ""),
        columns=["", *[SIDE_COLUMNS[k] for k in keys], *ratio_labels],
        rows=rows,
        result=result or "no ratio: (b) did not run",
        notes=notes,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workload",
        choices=[*WORKLOADS, "both", "all"],
        default="default",
        help="per-experiment budget preset(s): both = default + round; all = every preset",
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
        "--learning-rates",
        type=lambda s: tuple(float(x) for x in s.split(",") if x),
        default=None,
        help="comma-separated learning rates the K candidates cycle over (default: the preset's)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="rl.seed: prompt draw and LoRA init on every side, TRL's sampling RNG (vLLM rollouts are unseeded)",
    )
    parser.add_argument(
        "--sides",
        type=lambda s: [x for x in s.split(",") if x],
        default=["trl", "a", "b"],
        help="comma-separated sides to run: trl, a, b (default all three)",
    )
    parser.add_argument(
        "--update-mode", choices=["sequential", "one_pass"], default="one_pass", help="rl.update.mode of (b)'s round"
    )
    parser.add_argument(
        "--share-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="(b)'s base runs each prompt once for its G rows (trainer.model.logprobs)",
    )
    parser.add_argument(
        "--update-ratio",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the K candidates' update step sequential vs one-pass",
    )
    parser.add_argument(
        "--rollout-probe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after (b)'s round, time K adapters in one engine call vs one at a time",
    )
    parser.add_argument(
        "--limits",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure this machine's bandwidth and matmul rates and print (b)'s phases against them",
    )
    parser.add_argument(
        "--vllm-cpu-threads",
        default="all",
        help="cores vLLM's CPU worker binds (pipeline.config ServingConfig.cpu_threads: all, auto or e.g. 0); "
        "a learning check on a loaded host runs faster on one (with OMP_NUM_THREADS=1 for the trainers)",
    )
    parser.add_argument(
        "--vllm-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="vLLM's --dtype for (a) and (b): auto = what the service runs (float32 on CPU, pipeline.stack.vllm_dtype)",
    )
    parser.add_argument(
        "--steady",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after (b)'s round, run it again with the base kept and vLLM up: the steady-state round (TRL/(b) steady)",
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
    unknown = sorted(set(args.sides) - set(SIDE_COLUMNS))
    if unknown:
        parser.error(f"--sides: unknown {unknown}; choose from {list(SIDE_COLUMNS)}")
    args.recorder = writer.Recorder("multilora", args)
    args.one_pass_recorder = writer.Recorder("one-pass", args)
    args.model_dir = str(
        model_store.resolve(args.model, ModelConfig().cache_dir)
        if args.model in model_store.KNOWN_MODELS
        else Path(args.model)
    )
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-multilora-"))
    names = {"both": ["default", "round"], "all": list(WORKLOADS)}.get(args.workload, [args.workload])
    explicit = {k: v for k, v in vars(args).items() if k in WORKLOADS["default"] and v is not None}
    ratios = {}
    for name in names:
        run_args = argparse.Namespace(**(vars(args) | WORKLOADS[name] | explicit))
        run_args.out = str(out / name)
        ratios[name] = run_workload(name, run_args, out / name)
    for label in ("TRL/(b) steady", "TRL/(b)", "(a)/(b)"):  # the last lines: TRL/(b), steady and cold, then (a)/(b)
        measured = [f"speedup {label} at workload {n}: {r[label]:.2f}x" for n, r in ratios.items() if label in r]
        if measured:
            print("; ".join(measured))


if __name__ == "__main__":
    main()
