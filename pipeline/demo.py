"""The main job on the embedded default, end to end on this machine.

1. bring the local stack up (Tansu broker, MLflow on SQLite, vLLM with SmolLM2);
2. start the always-on service and the gateway as their own processes;
3. drive traffic through the gateway with the official ``openai`` client
   (reasoning-gym arithmetic; feedback = the user's check of each answer);
4. let the scheduler run rounds on a short interval, printing each one:
   traces ingested, every candidate's held-out reward next to the champion's,
   the winner or why none won, the promoted version, the hot-load time;
5. compare the final champion with the base on the same fresh prompts,
   answer a few questions through the gateway, plot held-out reward by round.

Run it with ``make demo`` (or ``python -m pipeline.demo --config deploy/demo.toml``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline import stack
from pipeline.cli import base_model_dir
from pipeline.cli_common import load
from pipeline.config import HourglassConfig
from pipeline.traffic import arithmetic_questions, create_demo_key, drive, is_correct

console = Console(soft_wrap=True)


def _spawn(name: str, args: list[str], cfg: HourglassConfig, config: Path) -> subprocess.Popen[bytes]:
    log = (stack.run_dir(cfg.state_dir) / f"{name}.log").open("ab")
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args, "--config", str(config)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_http(url: str, what: str, proc: subprocess.Popen[bytes], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with code {proc.returncode}; see its log under .hourglass/run/")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{what} did not answer {url} within {timeout_s:.0f}s")


def _wait_round(api: str, seen: set[str], timeout_s: float) -> dict[str, Any]:
    """The next round (not in ``seen``) once it has ended."""
    deadline = time.monotonic() + timeout_s
    shown = None
    while time.monotonic() < deadline:
        records = httpx.get(f"{api}/rounds", params={"limit": 50}, timeout=10).json()
        # Oldest unseen first (ids start with their UTC start time): a round that ended while the
        # scheduler already started the next one is still shown, in order.
        unseen = sorted((r for r in records if r["round_id"] not in seen and r["state"] != "cancelled"), key=lambda r: r["round_id"])
        if unseen:
            record = unseen[0]
            if (record["round_id"], record["state"]) != shown:
                console.print(f"  [dim]{time.strftime('%H:%M:%S')} round {record['round_id']}: {record['state']}[/]")
                shown = (record["round_id"], record["state"])
            if record["state"] in ("done", "no_winner", "failed"):
                return record
        time.sleep(3)
    raise SystemExit(f"no round ended within {timeout_s:.0f}s")


def _greedy_scores(vllm_url: str, model: str, questions: list[tuple[str, str]], reward) -> tuple[float, float]:
    """(mean reward under ``reward``, accuracy) of greedy answers from ``model`` on ``questions``.

    The requests go out 8 at a time so vLLM batches them."""

    def score(item: tuple[str, str]) -> tuple[float, bool]:
        question, reference = item
        messages = [{"role": "user", "content": question}]
        response = httpx.post(
            f"{vllm_url}/v1/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": 16, "temperature": 0.0},
            timeout=300,
        )
        response.raise_for_status()
        answer = response.json()["choices"][0]["message"]["content"] or ""
        return reward(messages, answer, {"reference_answer": reference}), is_correct(answer, reference)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(score, questions))
    return sum(r for r, _ in results) / len(results), sum(ok for _, ok in results) / len(results)


def _wait_serving(api: str, model: str, version: str | None, timeout_s: float = 60.0) -> dict[str, Any]:
    """The service's serving status for ``model`` once it serves ``version`` (hot-loads run after the round ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        serving = httpx.get(f"{api}/status", timeout=10).json().get("serving", {}).get(model, {})
        if version is None or str(serving.get("serving")) == version or time.monotonic() > deadline:
            return serving
        time.sleep(0.5)


def _plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [r["round"] for r in rows]
    ax.plot(xs, [r["champion"] for r in rows], "o-", label="champion (held-out)")
    ax.plot(xs, [r["best"] for r in rows], "s--", label="best candidate (held-out)")
    ax.set_xlabel("round")
    ax.set_ylabel("held-out reward")
    ax.set_xticks(xs)
    ax.legend()
    ax.set_title("Hourglass demo: held-out reward by round")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(
    config: Annotated[Path, typer.Option("--config", "-c")] = Path("deploy/demo.toml"),
    rounds: Annotated[int, typer.Option(help="Rounds to watch.")] = 3,
    traffic: Annotated[int, typer.Option(help="Requests before the first round.")] = 64,
    between: Annotated[int, typer.Option(help="Requests between rounds.")] = 32,
    keep_up: Annotated[bool, typer.Option(help="Leave the stack, service and gateway running.")] = False,
) -> None:
    """Run the whole loop on the embedded default and show it improve."""
    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below on SIGTERM too
    cfg = load(config)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    console.rule("1. local stack")
    for service in stack.stack_services(cfg, base_model_dir(cfg)):
        if not (stack.running_pid(service) and service.health()):
            console.print(f"starting {service.name} ...")
            service.start()
        console.print(f"{service.name}: healthy on {service.host}:{service.port}")
    from connectors.kafka_admin import ensure_topics

    ensure_topics(cfg.kafka)
    api, gateway = f"http://127.0.0.1:{cfg.api.port}", f"http://127.0.0.1:{cfg.api.gateway_port}"
    vllm_url = cfg.serving.replicas[0]
    key = create_demo_key(cfg.resolve(cfg.state_dir))  # trusted grader: the simulated users send reference answers
    procs = {"service": _spawn("service", ["service"], cfg, config), "gateway": _spawn("gateway", ["gateway"], cfg, config)}
    try:
        _wait_http(f"{api}/healthz", "the service", procs["service"])
        _wait_http(f"{gateway}/healthz", "the gateway", procs["gateway"])
        console.print(f"service (ops API) on {api}, gateway on {gateway}")

        console.rule("2. traffic through the gateway")
        exchanges = drive(gateway, cfg.serving.model_name, traffic, seed=1, api_key=key)
        console.print(f"{len(exchanges)} requests, users marked {sum(e.correct for e in exchanges)} answers right")
        sent, seen, rows = len(exchanges), set(), []
        for i in range(1, rounds + 1):
            console.rule(f"3.{i} round {i}")
            record = _wait_round(api, seen, timeout_s=900)
            seen.add(record["round_id"])
            buffer = httpx.get(f"{api}/buffer/stats", timeout=10).json()
            decision = next(iter(record["decisions"].values()), {})
            table = Table("candidate", "held-out reward", "lower bound vs champion")
            table.add_row("champion", f"{decision.get('champion_reward', float('nan')):.3f}", "")
            for name, reward in decision.get("candidate_rewards", {}).items():
                table.add_row(name, f"{reward:.3f}", f"{decision.get('lower_bounds', {}).get(name, float('nan')):+.3f}")
            console.print(f"traces sent {sent}, in the buffer {buffer.get('trace_rows')}; round state [bold]{record['state']}[/]")
            console.print(table)
            serving = _wait_serving(api, cfg.serving.model_name, (record.get("versions") or {}).get(cfg.serving.model_name))
            winner = decision.get("winner")
            hotload = serving.get("last_hotload_s")
            console.print(
                f"winner: {winner or 'none'} — {record['reason']}\n"
                f"gate: {escape(decision.get('reason', '-'))}\n"
                f"promoted: {record['versions'] or '-'}   serving now: {serving.get('serving')}   "
                f"hot-load: {f'{hotload:.2f}' if hotload is not None else '-'} s"
            )
            rewards = decision.get("candidate_rewards", {}) or {"-": float("nan")}
            rows.append({"round": i, "champion": decision.get("champion_reward", float("nan")), "best": max(rewards.values()), "state": record["state"]})
            if i < rounds:
                more = drive(gateway, cfg.serving.model_name, between, seed=100 + i, api_key=key)
                sent += len(more)
                console.print(f"{len(more)} more requests; users marked {sum(e.correct for e in more)} right")

        console.rule("4. the served model now")
        time.sleep(cfg.serving.reconcile_interval_s)  # let the reconcile loop settle the last promotion
        routes = json.loads((cfg.resolve(cfg.state_dir) / "routes.json").read_text()) if (cfg.resolve(cfg.state_dir) / "routes.json").exists() else {}
        champion = routes.get(cfg.serving.model_name, {}).get("served_name")
        from trainer.rewards import build_reward

        reward = build_reward(cfg.candidates[0].reward, skip_logged=True)  # the candidates' reward mix
        questions = arithmetic_questions(48, seed=999)  # fresh prompts, never seen in training
        final = Table("model", "held-out reward (greedy, 48 fresh prompts)", "accuracy")
        for label, name in [("base", cfg.serving.base_served_name), ("champion", champion)]:
            if name:
                mean_reward, accuracy = _greedy_scores(vllm_url, name, questions, reward)
                final.add_row(f"{label} ({name})", f"{mean_reward:.3f}", f"{accuracy:.3f}")
        console.print(final)
        for exchange in drive(gateway, cfg.serving.model_name, 3, seed=2024, concurrency=1, api_key=key):
            console.print(f"Q: {exchange.question}\nA: {exchange.answer!r}  ({'right' if exchange.correct else 'wrong'}, trace {exchange.trace_id})")
        plot = cfg.resolve(cfg.state_dir) / "demo-heldout-reward.png"
        _plot(rows, plot)
        console.print(f"plot: {plot}\ntotal time {time.monotonic() - started:.0f} s")
    finally:
        if not keep_up:
            for proc in procs.values():
                stack.stop_group(proc.pid)
            for service in reversed(stack.stack_services(cfg, Path("-"))):
                service.stop()
        else:
            console.print("left running; stop with `hourglass down` and by ending the service and gateway processes")


if __name__ == "__main__":
    typer.run(main)
