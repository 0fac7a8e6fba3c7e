"""K candidate experiments two ways, side by side in one run.

(a) traditional: one fresh process per experiment; each loads the base and
    starts its own vLLM server, trains one LoRA candidate, evaluates, exits.
    Experiments run one after another (this machine has 2 cores).
(b) hourglass: one process, one resident base with all K adapters (offload
    store), one shared vLLM server that samples for every adapter at once.

Identical work both ways: per candidate S GRPO steps of P prompts x G
rollouts, then greedy evaluation on the same held-out prompts. Prints wall
clock and peak memory (RSS of the process tree, trainer + vLLM, sampled every
0.2 s) of both, the swap time as a fraction of update time, rollout tokens/s
with K adapters in one engine vs one adapter at a time, and as the last line
the speedup (a)/(b). Both sides also print their round's phase breakdown
(``time/*_s`` round metrics, see trainer/profile.py; (a) summed over its
processes). ``--update-mode one_pass`` trains (b)'s candidates in one
forward/backward per step (trainer/multi_lora.py); (a) has one candidate per
process, where both modes are the same.

    python bench/multilora.py --k 2 --steps 1          # quick
    python bench/multilora.py                          # K=8, SmolLM2
"""

from __future__ import annotations

import argparse
import json
import os
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

from pipeline.stack import free_port, vllm_service
from trainer import model_store
from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.profile import PHASES


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
    mix = [RewardTerm(fn="format"), RewardTerm(fn="exact_answer")]
    return [CandidateConfig(name=f"c{i}", learning_rate=1e-4 * (1 + i % 4), lora_rank=8, reward=mix, start="fresh") for i in range(k)]


def rl_config(args: argparse.Namespace) -> RLConfig:
    return RLConfig(
        steps_per_round=args.steps, prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.max_new_tokens,
        eval_prompts=args.eval_prompts, adapter_store="offload", seed=0, update_mode=args.update_mode,
    )  # fmt: skip


def tables(args: argparse.Namespace):
    from trainer.tasks import reasoning_gym_prompts, snapshot_table, split_snapshot

    prompts = reasoning_gym_prompts("basic_arithmetic", 48, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    return split_snapshot(snapshot_table(prompts), 0.25)


def start_vllm(model: Path, logs: Path, max_loras: int):
    service = vllm_service(model, "127.0.0.1", free_port(), logs, max_model_len=512, kv_cache_gib=1, max_lora_rank=16, max_loras=max_loras)
    service.start()
    return service


def run_round_with_vllm(model: Path, cands: list[CandidateConfig], args: argparse.Namespace, out: Path, extra=None) -> dict:
    """Start a vLLM server, run one round, optionally measure rollout throughput, stop the server."""
    from trainer.rollout_vllm import VLLMEngine
    from trainer.candidates import run_round

    train, heldout = tables(args)
    started = time.perf_counter()
    service = start_vllm(model, out / "logs", max_loras=max(2, len(cands)))
    startup_s = time.perf_counter() - started
    try:
        engine = VLLMEngine(f"http://127.0.0.1:{service.port}")
        result = run_round(ModelConfig(name=str(model)), cands, rl_config(args), train, heldout, {}, out / "round", engine=engine, progress=False)
        metrics = [m for c in result.candidates for m in c.step_metrics]
        report = {
            "vllm_startup_s": startup_s,
            "swap_s": sum(m["train/swap_s"] for m in metrics),
            "update_s": sum(m["train/update_s"] for m in metrics),
            "eval_reward": {c.name: c.eval_metrics["eval/reward_mean"] for c in result.candidates},
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

    from trainer.rollout import RolloutRequest
    from trainer.tasks import prompts_from_table

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    train, _ = tables(args)

    prompts = prompts_from_table(train)[: args.prompts]
    ids = [tuple(tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]) for p in prompts]
    versions = []
    for c in result.candidates:
        engine.load(c.name, f"bench-{c.name}", c.adapter_dir)
        versions.append(f"bench-{c.name}")

    def reqs(vs: list[str]) -> list[RolloutRequest]:
        return [RolloutRequest(version=v, prompt_id=p.prompt_id, prompt_token_ids=i, n=args.group, max_new_tokens=args.max_new_tokens, seed=1)
                for v in vs for p, i in zip(prompts, ids)]  # fmt: skip

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


def phases(reports: list[dict[str, float]]) -> str:
    """``rollout 12.3 s, reference 1.0 s, ...``: phase times summed over reports."""
    return ", ".join(f"{k.removeprefix('time/').removesuffix('_s')} {sum(r.get(k, 0.0) for r in reports):.1f} s" for k in PHASES)


def worker(args: argparse.Namespace) -> None:
    """(a) one experiment in its own process; writes a JSON report."""
    cand = candidates(args.k)[args.worker]
    out = Path(args.out) / f"a-{cand.name}"
    report = run_round_with_vllm(Path(args.model_dir), [cand], args, out)
    Path(args.report).write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=8, help="candidate experiments")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per candidate")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="rollouts per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--eval-prompts", type=int, default=4)
    parser.add_argument("--update-mode", choices=["sequential", "one_pass"], default="sequential", help="rl.update_mode of the rounds")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="packaged model key or folder")
    parser.add_argument("--out", default=None, help="work folder (default: a temp dir)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--report", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return
    args.model_dir = str(model_store.resolve(args.model, ModelConfig().cache_dir) if args.model in model_store.KNOWN_MODELS else Path(args.model))
    args.out = args.out or tempfile.mkdtemp(prefix="bench-multilora-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"K={args.k} update_mode={args.update_mode} steps={args.steps} P={args.prompts} G={args.group} max_new_tokens={args.max_new_tokens} model={args.model_dir}")

    # (a) traditional: K fresh processes, each with its own base and vLLM server
    started = time.perf_counter()
    peak_a, reports = 0, []
    for i in range(args.k):
        report_path = out / f"a-{i}.json"
        argv = [sys.executable, __file__, "--worker", str(i), "--report", str(report_path), "--model-dir", args.model_dir,
                "--k", str(args.k), "--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group),
                "--max-new-tokens", str(args.max_new_tokens), "--eval-prompts", str(args.eval_prompts), "--out", str(out),
                "--update-mode", args.update_mode]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=(out / f"a-{i}.log").open("wb"))
        with PeakRSS(proc.pid) as mem:
            if proc.wait() != 0:
                raise SystemExit(f"experiment {i} failed; see {out / f'a-{i}.log'}")
        peak_a = max(peak_a, mem.peak)
        reports.append(json.loads(report_path.read_text()))
    wall_a = time.perf_counter() - started
    print(f"(a) traditional: {args.k} processes, wall {wall_a:.1f} s, peak RSS {peak_a / 2**30:.2f} GiB, "
          f"vLLM startup total {sum(r['vllm_startup_s'] for r in reports):.1f} s")  # fmt: skip

    # (b) one resident base, K adapters, one shared vLLM engine
    started = time.perf_counter()
    with PeakRSS(os.getpid()) as mem:
        report_b = run_round_with_vllm(
            Path(args.model_dir), candidates(args.k), args, out / "b", extra=lambda e, r: rollout_throughput(e, r, args)
        )
    # The rollout throughput probe runs after the round; it is not part of (b)'s work.
    wall_b = time.perf_counter() - started - report_b["extra_s"]
    print(f"(b) resident base + shared vLLM: 1 process, wall {wall_b:.1f} s, peak RSS {mem.peak / 2**30:.2f} GiB, "
          f"vLLM startup {report_b['vllm_startup_s']:.1f} s")  # fmt: skip
    print(f"swap time / update time in (b): {report_b['swap_s']:.3f} s / {report_b['update_s']:.1f} s = "
          f"{report_b['swap_s'] / max(report_b['update_s'], 1e-9):.2%}")  # fmt: skip
    together, one = report_b["rollout_together_tok_s"], report_b["rollout_one_at_a_time_tok_s"]
    print(f"rollout tokens/s, {args.k} adapters in one engine call: {together:.1f}; one adapter at a time: {one:.1f}; ratio {together / one:.2f}x")
    print(f"phases (a), summed: {phases([r['phases'] for r in reports])}")
    print(f"phases (b): {phases([report_b['phases']])}")
    print(f"eval reward (a): {[round(v, 3) for r in reports for v in r['eval_reward'].values()]}  (b): {[round(v, 3) for v in report_b['eval_reward'].values()]}")
    print(f"speedup (a)/(b): {wall_a / wall_b:.2f}x")


if __name__ == "__main__":
    main()
