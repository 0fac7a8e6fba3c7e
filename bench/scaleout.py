"""Scale-out overhead: the same round on the local executor and on Ray with 1 and 2 trainer actors.

One process runs the same round (K candidates, the same data, seeds and
settings) side by side: ``rl.executor = "local"``, then ``"ray"`` with 1
actor, then with 2 actors, on a local Ray cluster started once beforehand (its
start-up is printed, not counted: a service keeps its cluster). Each Ray
configuration runs twice with ``rl.ray_keep_actors``: ``cold`` (the round
starts its actors: process, imports, base load) and ``warm`` (the next round
on the kept actors). The local round runs again at the end; the ratios of the
last line are to the mean of the two local rounds.
Rollouts use transformers on each actor (``--engine hf``, default) or a vLLM
server (``--engine vllm --rollout-url http://host:port``).

CPU hosts: the local round and every actor use ``--threads`` torch threads
(default 1; each actor reserves as many CPUs), so the 1-actor run does the
local run's work with the same threads and the 2-actor run splits it over two
processes. GPU hosts: one GPU per actor (``--actors-max`` as many as there are GPUs).

Prints per run: round wall time, its ratio to the local run, the training
phase's wall time, each actor's utilisation (busy time in its ``train`` call /
the training phase's wall time, as the executor measures it), and the gate's
winner (the same in every run: the executors train the same candidates the
same way). The last line is the 1-actor / local wall-time ratio.

    python bench/scaleout.py                                  # tiny random Llama, K=4, CPU
    python bench/scaleout.py --model smollm2 --candidates 4 --steps 2
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
)  # actors import this checkout

import torch  # noqa: E402

from trainer import model_store  # noqa: E402
from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig  # noqa: E402
from trainer.candidates import run_round  # noqa: E402
from trainer.ray_executor import release_kept_actors  # noqa: E402
from trainer.tasks import reasoning_gym_prompts, snapshot_table, split_snapshot  # noqa: E402

CACHE = Path(os.environ.get("HOURGLASS_MODEL_CACHE", "~/.cache/hourglass/models")).expanduser()


def model_dir(which: str) -> Path:
    smollm2 = model_store.pull("smollm2-135m-instruct", CACHE).path
    if which == "smollm2":
        return smollm2
    return model_store.build_tiny_llama(CACHE / "tiny-random-llama", tokenizer_from=smollm2).path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--candidates", type=int, default=4, help="K candidates")
    parser.add_argument("--steps", type=int, default=4, help="rl.steps_per_round")
    parser.add_argument("--prompts", type=int, default=2, help="rl.prompts_per_step")
    parser.add_argument("--group", type=int, default=4, help="rl.group_size")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--rollout-url", default=None, help="vLLM base URL (--engine vllm)")
    parser.add_argument("--actors-max", type=int, default=2, help="run Ray with 1..N actors")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the local round and of each CPU actor (its rl.ray_actor_cpus); 1 keeps a loaded host from "
        "oversubscribing its cores (OpenMP threads spin at barriers when another process holds a core)",
    )
    args = parser.parse_args()

    import ray

    gpus = torch.cuda.device_count()
    cpus = os.cpu_count() or 1
    torch.set_num_threads(args.threads)
    model = ModelConfig(name=str(model_dir(args.model)), dtype="float32")
    prompts = reasoning_gym_prompts(
        "basic_arithmetic", 48, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    train, heldout = split_snapshot(snapshot_table(prompts), 0.25)
    lrs = [1e-3 * (0.5**i) for i in range(args.candidates)]
    cands = [
        CandidateConfig(name=f"c{i}", learning_rate=lr, start="fresh", reward=[RewardTerm(fn="format")])
        for i, lr in enumerate(lrs)
    ]
    rl = RLConfig(
        steps_per_round=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group,
        max_new_tokens=args.max_new_tokens,
        rollout_engine=args.engine,
        rollout_url=args.rollout_url,
        eval_prompts=8,
        bootstrap_samples=200,
        max_kl=100.0,
    )
    print(
        f"model {args.model}, K={args.candidates}, steps {args.steps} x {args.prompts} prompts x G={args.group}, "
        f"{args.max_new_tokens} new tokens, engine {args.engine}; {cpus} CPUs, {gpus} GPUs, {args.threads} torch thread(s) "
        f"per process, load {os.getloadavg()}"
    )
    os.environ.setdefault(
        "RAY_memory_monitor_refresh_ms", "0"
    )  # a shared host's memory must not kill the measured actors
    started = time.perf_counter()
    ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    print(f"ray cluster start {time.perf_counter() - started:.1f}s (not counted)")
    runs: list[tuple[str, RLConfig]] = [("local", rl)]
    for n in range(1, args.actors_max + 1):
        sizing = (
            {"ray_actor_gpus": 1, "ray_actor_cpus": args.threads}
            if gpus
            else {"ray_actor_gpus": 0, "ray_actor_cpus": args.threads}
        )
        on_ray = rl.model_copy(update={"executor": "ray", "ray_actors": n, "ray_keep_actors": True, **sizing})
        runs += [
            (f"ray-{n}-cold", on_ray),
            (f"ray-{n}-warm", on_ray),
        ]  # cold: actors start; warm: the kept actors train again
    runs.append(
        ("local-end", rl)
    )  # the local round again: a load that drifts during the run shows as a gap between the two
    walls: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hourglass-scaleout-") as tmp:
        for label, cfg in runs:
            t0 = time.perf_counter()
            result = run_round(
                model, cands, cfg, train, heldout, {}, Path(tmp) / label / "r1", progress=False, round_id="r1"
            )
            walls[label] = time.perf_counter() - t0
            if label.endswith("-warm"):
                release_kept_actors()
            m = result.metrics
            actors = range(int(m.get("executor/actors", 0)))
            util = " ".join(f"actor{i} {m[f'executor/actor{i}/utilisation']:.2f}" for i in actors)
            if (
                util
            ):  # the training phase's wall time no actor spent in train(): process start, imports, base load, copies
                util += f"  (start-up and hand-over {m['executor/train_wall_s'] - max(m[f'executor/actor{i}/busy_s'] for i in actors):.1f}s)"
            train_s = m.get("executor/train_wall_s", m.get("time/train_s", float("nan")))
            print(
                f"{label:10s} wall {walls[label]:7.1f}s  x{walls[label] / walls['local']:.2f} vs the first local  train phase {train_s:6.1f}s  "
                f"{util or '(in process)'}  winner {result.decisions['hourglass'].winner}",
                flush=True,
            )
    ray.shutdown()
    print(f"load after: {os.getloadavg()}")
    local = (walls["local"] + walls["local-end"]) / 2
    print(
        f"ray-1 / local wall time (mean of the two local rounds): {walls['ray-1-warm'] / local:.2f}x warm (kept actors), {walls['ray-1-cold'] / local:.2f}x cold"
    )


if __name__ == "__main__":
    main()
