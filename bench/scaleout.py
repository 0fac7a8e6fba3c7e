"""Scale-out overhead: the same round on the local executor and on Ray with 1..N trainer actors, as the service runs it.

One process runs the same round (K candidates, the same data, seeds and
settings) side by side: ``rl.executor = "local"``, then ``"ray"`` with 1
actor, then with 2 actors, on a local Ray cluster started once beforehand (its
start-up is printed, not counted: a service keeps its cluster). Rounds run the
way ``hourglass service`` runs them: every round loads the driver's base
(as the service's rounds do), and on Ray the service keeps its trainer actors
between rounds (``rl.ray.keep_actors``, on in the service) and starts them at
its own start. So each setting prints:

- ``cold``: the first round of a service that has not started its actors yet
  (they start with the round, overlapped with the driver's base load, plan and
  tokenisation; ``start wait`` is the start-up the round still waited for).
  A service pays this once, at its first round after start (the service warms
  its actors in the background at start, so usually not even then);
- ``warm 1..R``: the steady state, rounds on the kept actors; their mean is the
  figure to compare with the local rounds' mean.

The local round runs ``R`` times first and again at the end (a load that
drifts during the run shows as a gap between the two).
Rollouts use transformers on each actor (``--engine hf``, default) or a vLLM
server (``--engine vllm --rollout-url http://host:port``).

CPU hosts: the local round and every actor use ``--threads`` torch threads
(default 1; each actor reserves as many CPUs), so the 1-actor run does the
local run's work with the same threads and the 2-actor run splits it over two
processes. GPU hosts: one GPU per actor (``--actors-max`` as many as there are GPUs).

Prints per round: wall time, its ratio to the mean local round, the training
phase's wall time, the actors' start-up the round waited for, each actor's
utilisation (busy time in its ``train`` call / the training phase's wall time),
and the gate's winner (the same in every run: the executors train the same
candidates the same way). The last lines are the ratios to the local mean.

    python bench/scaleout.py                                  # tiny random Llama, K=4, CPU
    python bench/scaleout.py --quick                          # a smoke run: K=2, 1 step, 1 actor, 2 rounds each
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

from bench import writer  # noqa: E402
from trainer.model import store as model_store  # noqa: E402
from trainer.config import CandidateConfig, GateConfig, ModelConfig, RayConfig, RewardTerm, RLConfig, RolloutConfig  # noqa: E402
from trainer.evaluation.gate import gate_round  # noqa: E402
from trainer.round import run_round  # noqa: E402
from trainer.types import RoundSpec  # noqa: E402
from trainer.executors.ray_executor import release_kept_actors  # noqa: E402
from trainer.tasks import reasoning_gym_prompts  # noqa: E402
from trainer.data import round_inputs, snapshot_table, split_snapshot

CACHE = Path(os.environ.get("HOURGLASS_MODEL_CACHE", "~/.cache/hourglass/models")).expanduser()


def model_dir(which: str) -> Path:
    smollm2 = model_store.pull("smollm2-135m-instruct", CACHE).path
    if which == "smollm2":
        return smollm2
    return model_store.build_tiny_llama(CACHE / "tiny-random-llama", tokenizer_from=smollm2).path


def _round(model, cands, cfg, train, heldout, out: Path, label: str, local_s: float | None) -> float:
    """One round; prints its line and returns its wall time."""
    t0 = time.perf_counter()
    result = gate_round(
        run_round(RoundSpec(model, tuple(cands), cfg), round_inputs(train, heldout), out, round_id="r1"), cfg
    )
    wall = time.perf_counter() - t0
    m = result.metrics
    actors = range(int(m.get("executor/actors", 0)))
    util = " ".join(f"actor{i} {m[f'executor/actor{i}/utilisation']:.2f}" for i in actors)
    if util:
        util += f"  start wait {m['executor/start_wait_s']:.1f}s placement {m['executor/placement_wait_s']:.1f}s"
    train = (
        f"{m['executor/train_wall_s']:6.1f}s" if "executor/train_wall_s" in m else "      -"
    )  # Ray: the actors' phase
    ratio = f"x{wall / local_s:.2f}" if local_s else "     "
    print(
        f"{label:16s} wall {wall:7.1f}s  {ratio}  train phase {train}  {util or '(in process)'}  "
        f"winner {result.decisions['hourglass'].winner}",
        flush=True,
    )
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--candidates", type=int, default=4, help="K candidates")
    parser.add_argument("--steps", type=int, default=4, help="rl.steps_per_round")
    parser.add_argument("--prompts", type=int, default=2, help="rl.prompts_per_step")
    parser.add_argument("--group", type=int, default=4, help="rl.rollout.group_size")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--rollout-url", default=None, help="vLLM base URL (--engine vllm)")
    parser.add_argument("--actors-max", type=int, default=2, help="run Ray with 1..N actors")
    parser.add_argument(
        "--rounds", type=int, default=3, help="R: local rounds, and steady-state rounds per Ray setting"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the local round and of each CPU actor (its rl.ray.actor_cpus); 1 keeps a loaded host from "
        "oversubscribing its cores (OpenMP threads spin at barriers when another process holds a core)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: K=2, 1 step x 1 prompt x G=2, 4 tokens, 1 actor, R=2"
    )
    writer.add_arguments(parser)
    args = parser.parse_args()
    recorder = writer.Recorder("scaleout", args)
    if args.quick:
        args.candidates, args.steps, args.prompts, args.group, args.max_new_tokens = 2, 1, 1, 2, 4
        args.actors_max, args.rounds = 1, 2

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
        rollout=RolloutConfig(
            group_size=args.group, max_new_tokens=args.max_new_tokens, engine=args.engine, url=args.rollout_url
        ),
        gate=GateConfig(eval_prompts=8, bootstrap_samples=200, max_kl=100.0),
    )
    print(
        f"model {args.model}, K={args.candidates}, steps {args.steps} x {args.prompts} prompts x G={args.group}, "
        f"{args.max_new_tokens} new tokens, engine {args.engine}; {cpus} CPUs, {gpus} GPUs, {args.threads} torch thread(s) "
        f"per process, R={args.rounds}; load {os.getloadavg()}"
    )
    os.environ.setdefault(
        "RAY_memory_monitor_refresh_ms", "0"
    )  # a shared host's memory must not kill the measured actors
    started = time.perf_counter()
    ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    print(f"ray cluster start {time.perf_counter() - started:.1f}s (not counted)")
    sizing = {"actor_gpus": 1 if gpus else 0, "actor_cpus": args.threads}
    local: list[float] = []
    cold: dict[int, float] = {}
    warm: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="hourglass-scaleout-") as tmp:
        root = Path(tmp)
        for r in range(args.rounds):
            local.append(_round(model, cands, rl, train, heldout, root / f"local-{r}", f"local {r + 1}", None))
        mean_local = sum(local) / len(local)
        for n in range(1, args.actors_max + 1):
            # as in the service: kept actors; the first round starts them (overlapped with the driver's own start-up)
            on_ray = rl.model_copy(update={"executor": "ray", "ray": RayConfig(actors=n, keep_actors=True, **sizing)})
            cold[n] = _round(model, cands, on_ray, train, heldout, root / f"ray{n}-cold", f"ray-{n} cold", mean_local)
            warm[n] = [
                _round(model, cands, on_ray, train, heldout, root / f"ray{n}-w{r}", f"ray-{n} warm {r + 1}", mean_local)
                for r in range(args.rounds)
            ]
            release_kept_actors()
        end = _round(model, cands, rl, train, heldout, root / "local-end", "local end", mean_local)
    ray.shutdown()
    print(f"load after: {os.getloadavg()}")
    local_all = (sum(local) + end) / (len(local) + 1)
    print(f"local: mean {local_all:.1f}s over {len(local) + 1} rounds ({', '.join(f'{x:.1f}' for x in [*local, end])})")
    rows = [["local", f"{local_all:.1f} s ({', '.join(f'{x:.1f}' for x in [*local, end])})", "1.00x", ""]]
    lines = []
    for n in cold:
        steady = sum(warm[n]) / len(warm[n])
        lines.append(
            f"ray-{n} / local wall time: {steady / local_all:.2f}x steady state (mean of {len(warm[n])} rounds on kept "
            f"actors, as the service runs); {cold[n] / local_all:.2f}x for a first round that starts its actors"
        )
        rows.append(
            [
                f"Ray, {n} actor{'s' if n > 1 else ''}",
                f"{steady:.1f} s ({', '.join(f'{x:.1f}' for x in warm[n])}) on kept actors",
                f"**{steady / local_all:.2f}x**",
                f"{cold[n]:.1f} s, {cold[n] / local_all:.2f}x",
            ]
        )
    recorder.write(
        f"{args.model}-{'gpu' if gpus else 'cpu'}" + ("-quick" if args.quick else ""),
        title=f"{args.model} model, K = {args.candidates}, {args.steps} steps x {args.prompts} prompts x G = {args.group} x "
        f"{args.max_new_tokens} new tokens, {args.engine} rollouts, {args.threads} torch thread(s) per process, R = {args.rounds}",
        columns=["executor", "round wall time (mean, each)", "/ local, steady state", "first round (actors start)"],
        rows=rows,
        result=lines[0] if lines else "no Ray setting ran",
        notes=lines[1:]
        + ["per-round lines above the table in the output give each actor's utilisation and start wait"],
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
