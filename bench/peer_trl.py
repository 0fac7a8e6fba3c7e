"""The TRL side of ``bench/multilora.py``: K experiments with TRL's ``GRPOTrainer`` + PEFT, one process each,
one after another, in the scratch venv of ``bench/trl_env.py`` (built on first use).

The parent draws every experiment's data with the round's own code (:func:`experiment_spec`: the same
training prompts per step as ``trainer.plan.draw_prompts`` draws, the same held-out prompts
as ``trainer.evaluation.evaluate.eval_prompts``) and hands it to ``bench/trl_grpo.py`` as JSON; each process
reports its phase times (imports, load, train, evaluate) and what it learned.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import trl_env
from bench.peak_rss import PeakRSS

ROOT = Path(__file__).resolve().parents[1]
TRL_PHASES = ("imports", "load", "train", "evaluate")


def experiment_spec(
    candidate: Any, rl: Any, train: Any, heldout: Any, model_dir: str, eval_reward: list[Any]
) -> dict[str, Any]:
    """What one TRL process needs: its candidate, the workload, the training prompts in the order the round
    draws them (step by step) and the held-out prompts the round evaluates on."""
    from trainer.evaluation.evaluate import eval_prompts
    from trainer.plan import draw_prompts
    from trainer.rewards import build_reward
    from trainer.data import prompts_from_table

    mix = build_reward(candidate.reward)
    pool = [p for p in prompts_from_table(train) if mix.accepts(p.metadata)]
    steps = [draw_prompts(pool, rl.prompts_per_step, rl.seed * 7919 + step) for step in range(rl.steps_per_round)]
    held = eval_prompts(prompts_from_table(heldout), rl)

    def row(p: Any) -> dict[str, Any]:
        return {"prompt_id": p.prompt_id, "messages": list(p.messages), "metadata": dict(p.metadata)}

    return {
        "model_dir": model_dir,
        "seed": rl.seed,
        "candidate": candidate.model_dump(mode="json"),
        "eval_reward": [t.model_dump(mode="json") for t in eval_reward],
        "workload": {
            "steps": rl.steps_per_round,
            "prompts": rl.prompts_per_step,
            "group": rl.rollout.group_size,
            "max_new_tokens": rl.rollout.max_new_tokens,
            "temperature": rl.rollout.temperature,
            "clip_eps": rl.update.clip_eps,
            "max_grad_norm": rl.update.max_grad_norm,
        },
        "train_rows": [row(p) for prompts in steps for p in prompts],
        "eval_rows": [row(p) for p in held],
    }


def run_experiment(python: Path, spec: dict[str, Any], out: Path) -> tuple[dict[str, Any], int]:
    """One TRL process on ``spec``; returns its report and the peak RSS of its process tree (bytes).

    Raises:
        SystemExit: the process failed (its log is named).
    """
    out.mkdir(parents=True, exist_ok=True)
    spec_path, report_path, log_path = out / "spec.json", out / "report.json", out / "trl.log"
    spec_path.write_text(json.dumps(spec))
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = [str(python), str(ROOT / "bench" / "trl_grpo.py"), str(spec_path), str(report_path), repr(time.time())]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        with PeakRSS(proc.pid) as mem:
            if proc.wait() != 0:
                raise SystemExit(f"TRL experiment failed; see {log_path}")
    return json.loads(report_path.read_text()), mem.peak


def run_side(
    model_dir: str, candidates: list[Any], rl: Any, tables: Any, eval_reward: list[Any], out: Path
) -> dict[str, Any]:
    """All K experiments one after another; wall (venv build excluded), peak RSS, per-experiment reports."""
    python = trl_env.ensure()  # once; not timed
    train, heldout = tables

    started = time.perf_counter()
    reports, peak = [], 0
    for c in candidates:
        spec = experiment_spec(c, rl, train, heldout, model_dir, eval_reward)
        report, rss = run_experiment(python, spec, out / f"trl-{c.name}")
        reports.append(report)
        peak = max(peak, rss)
    return {"wall_s": time.perf_counter() - started, "peak_rss": peak, "reports": reports}


def judge(
    engine: Any,
    reports: list[dict[str, Any]],
    eval_rows: list[dict[str, Any]],
    tokenizer: Any,
    rl: Any,
    eval_reward: list[Any],
) -> dict[str, float]:
    """Each TRL experiment's saved adapter answered greedily on the held-out rows by the round's own evaluator
    (``engine``: (b)'s vLLM; one engine call for all of them, :func:`trainer.evaluation.measure.greedy_sets`) and
    scored by ``eval_reward``: ``{candidate: mean}``. The TRL processes judge themselves with ``generate`` in
    bf16; this is the same judge as (b)'s, so the two sides' learning differs only by what they learned. The
    adapters are unloaded again before it returns."""
    from trainer.evaluation.measure import GreedySet, greedy_sets
    from trainer.model.base import chat_token_ids
    from trainer.rewards import build_reward
    from trainer.types import Prompt

    prompts = [Prompt(r["prompt_id"], list(r["messages"]), dict(r["metadata"])) for r in eval_rows]
    ids = [chat_token_ids(tokenizer, r["messages"]) for r in eval_rows]
    versions = {name: f"trl-{name}" for r in reports for name in r["eval_reward"]}
    for r in reports:
        for name in r["eval_reward"]:
            engine.load(name, versions[name], Path(r["adapter_dir"]))
    try:
        answers = greedy_sets(
            engine, [GreedySet(list(versions.values()), prompts, ids, rl.rollout.max_new_tokens)], rl.seed
        )[0]
    finally:
        for version in versions.values():
            engine.unload(version)
    score = build_reward(eval_reward)
    return {
        name: sum(score(r["messages"], a.text, r["metadata"]) for r, a in zip(eval_rows, answers[v], strict=True))
        / max(1, len(eval_rows))
        for name, v in versions.items()
    }


def phases_line(reports: list[dict[str, Any]]) -> str:
    """``imports 66.6 s, load 10.5 s, train 86.1 s, evaluate 85.8 s``: summed over experiments."""
    return ", ".join(f"{k} {sum(r['phases'][k] for r in reports):.1f} s" for k in TRL_PHASES)
