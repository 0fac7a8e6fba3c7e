"""The main job on the embedded default, end to end on this machine: the served
model learns from what its users say, and nothing else.

1. bring the local stack up (Tansu broker, MLflow on SQLite, vLLM with SmolLM2);
2. start the always-on service and the gateway as their own processes;
3. drive traffic through the gateway with the official ``openai`` client
   (reasoning-gym arithmetic; feedback = each simulated user's thumbs up/down);
4. let the scheduler run rounds on a short interval, printing each one: the
   reward model's held-out AUC, every candidate's gate value next to the
   champion's (per served model), the winner or why none won, the promoted
   version, the hot-load time; then more traffic, served by the new champion;
5. the scoreboard: the users' live thumbs-up rate of each phase's traffic
   (from the reward buffer), greedy accuracy by the users' own check on fresh
   prompts for the base, the final champion and the oracle (a recipe trained on
   that very check, served as its own model so it never competes for
   promotion), feedback-only gain / oracle gain; a plot of the live rate.

The candidates of ``hourglass`` see only the users' feedback (reward model,
KTO) and the gate uses no reference answer; the reference answers the traffic
carries feed only this scoreboard and the oracle recipe.

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
from pipeline.cli.main import base_model_dir
from pipeline.cli.common import load
from pipeline.config import HourglassConfig
from pipeline.demo.board import LiveRate, gain_ratio, live_rates, plot_live_rates
from pipeline.demo.traffic import Exchange, arithmetic_questions, create_demo_key, drive, is_correct

console = Console(soft_wrap=True)
ORACLE_MODEL = "hourglass-oracle"  # the oracle recipe's own served model (deploy/demo.toml)


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


def _greedy_accuracy(vllm_url: str, model: str, questions: list[tuple[str, str]]) -> float:
    """Share of greedy answers from ``model`` on ``questions`` that the users' check accepts.

    The requests go out 8 at a time so vLLM batches them."""

    def right(item: tuple[str, str]) -> bool:
        question, reference = item
        response = httpx.post(
            f"{vllm_url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0.0},
            timeout=300,
        )
        response.raise_for_status()
        return is_correct(response.json()["choices"][0]["message"]["content"] or "", reference)

    with ThreadPoolExecutor(max_workers=8) as pool:
        return sum(pool.map(right, questions)) / len(questions)


def _wait_serving(api: str, model: str, version: str | None, timeout_s: float = 60.0) -> dict[str, Any]:
    """The service's serving status for ``model`` once it serves ``version`` (hot-loads run after the round ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        serving = httpx.get(f"{api}/status", timeout=10).json().get("serving", {}).get(model, {})
        if version is None or str(serving.get("serving")) == version or time.monotonic() > deadline:
            return serving
        time.sleep(0.5)


def _live_verdict(cfg: HourglassConfig, phases: list[list[str]], timeout_s: float = 60.0) -> list[LiveRate]:
    """The users' verdict per phase from the reward buffer, once every sent trace's feedback has landed there (or ``timeout_s``)."""
    from connectors.buffer import RewardBuffer

    sent = sum(len(p) for p in phases)
    deadline = time.monotonic() + timeout_s
    while True:
        rates = live_rates(RewardBuffer(cfg.buffer).snapshot(), phases)
        if sum(r.rated for r in rates) >= sent or time.monotonic() > deadline:
            return rates
        time.sleep(2)


def _say_sent(exchanges: list[Exchange], what: str) -> None:
    console.print(f"{len(exchanges)} {what}; users gave {sum(e.correct for e in exchanges)} thumbs up")


def _num(value: Any, spec: str = ".3f") -> str:
    """A number from a round record as text; the API sends NaN as null, shown as '-'."""
    return "-" if value is None or value != value else format(value, spec)


def _print_round(record: dict[str, Any], sent: int, buffer: dict[str, Any]) -> None:
    """One round: the reward model's held-out AUC, then per served model the gate values and the verdict."""
    metrics = record.get("metrics") or {}
    console.print(
        f"traces sent {sent}, in the buffer {buffer.get('trace_rows')}; round state [bold]{record['state']}[/]; "
        f"reward model held-out AUC {_num(metrics.get('reward_model/auc'))}"
    )
    for model, decision in (record.get("decisions") or {}).items():
        table = Table(f"{model}: candidate", f"gate value ({decision.get('metric', '-')})", "lower bound vs champion")
        table.add_row("champion", _num(decision.get("champion_reward")), "")
        for name, value in (decision.get("candidate_rewards") or {}).items():
            table.add_row(name, _num(value), _num((decision.get("lower_bounds") or {}).get(name), "+.3f"))
        console.print(table)
        console.print(f"{model}: winner {decision.get('winner') or 'none'}; gate: {escape(decision.get('reason', '-'))}")


def _print_scoreboard(rates: list[LiveRate], accuracy: dict[str, float], aucs: list[float | None]) -> None:
    live = Table("phase", "served by (version: up/rated)", "users' thumbs-up", "rate", title="The users' live verdict")
    for r in rates:
        label = "before round 1" if r.phase == 0 else f"after round {r.phase}"
        served = ", ".join(f"{v}: {u}/{n}" for v, (u, n) in r.served_by.items()) or "-"
        live.add_row(label, served, f"{r.up}/{r.rated}", f"{r.rate:.0%}" if r.rated else "-")
    console.print(live)
    if rates and rates[0].rated and rates[-1].rated and rates[0].rate > 0:
        console.print(f"last phase / first phase thumbs-up rate: {rates[-1].rate / rates[0].rate:.1f}x")
    greedy = Table("model", "greedy accuracy by the users' check (48 fresh prompts)", title="Fresh prompts")
    for label, value in accuracy.items():
        greedy.add_row(label, f"{value:.3f}")
    console.print(greedy)
    console.print("reward model held-out AUC by round: " + ", ".join(_num(a) for a in aucs))


def main(
    config: Annotated[Path, typer.Option("--config", "-c")] = Path("deploy/demo.toml"),
    rounds: Annotated[int, typer.Option(help="Rounds to watch.")] = 3,
    traffic: Annotated[int, typer.Option(help="Requests before the first round.")] = 96,
    between: Annotated[int, typer.Option(help="Requests after each round (served by its champion).")] = 32,
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
        console.print(f"service (ops API) on {api}, gateway on {gateway}; status page: {api}/")

        console.rule("2. traffic through the gateway")
        exchanges = drive(gateway, cfg.serving.model_name, traffic, seed=1, api_key=key)
        _say_sent(exchanges, "requests (served by the base)")
        phases, aucs, seen = [[e.trace_id for e in exchanges]], [], set()
        for i in range(1, rounds + 1):
            console.rule(f"3.{i} round {i}")
            record = _wait_round(api, seen, timeout_s=900)
            seen.add(record["round_id"])
            _print_round(record, sum(len(p) for p in phases), httpx.get(f"{api}/buffer/stats", timeout=10).json())
            aucs.append((record.get("metrics") or {}).get("reward_model/auc"))
            serving = _wait_serving(api, cfg.serving.model_name, (record.get("versions") or {}).get(cfg.serving.model_name))
            hotload = serving.get("last_hotload_s")
            console.print(
                f"round: {escape(record['reason'])}\npromoted: {record['versions'] or '-'}   serving now: {serving.get('serving')}   "
                f"hot-load: {f'{hotload:.2f}' if hotload is not None else '-'} s"
            )
            more = drive(gateway, cfg.serving.model_name, between, seed=100 + i, api_key=key)  # the phase after round i, served by its champion
            phases.append([e.trace_id for e in more])
            _say_sent(more, "more requests")

        console.rule("4. the scoreboard")
        time.sleep(cfg.serving.reconcile_interval_s)  # let the reconcile loop settle the last promotion
        routes_file = cfg.resolve(cfg.state_dir) / "routes.json"
        routes = json.loads(routes_file.read_text()) if routes_file.exists() else {}
        questions = arithmetic_questions(48, seed=999)  # fresh prompts, never seen in training
        accuracy = {f"base ({cfg.serving.base_served_name})": _greedy_accuracy(vllm_url, cfg.serving.base_served_name, questions)}
        for label, model in [("champion", cfg.serving.model_name), ("oracle", ORACLE_MODEL)]:
            served = routes.get(model, {}).get("served_name")
            if served:
                accuracy[f"{label} ({served})"] = _greedy_accuracy(vllm_url, served, questions)
        rates = _live_verdict(cfg, phases)
        _print_scoreboard(rates, accuracy, aucs)
        values = list(accuracy.values())
        if len(values) == 3:
            base_acc, champion_acc, oracle_acc = values
            console.print(
                f"feedback-only gain {champion_acc - base_acc:+.3f}, oracle gain {oracle_acc - base_acc:+.3f}: "
                f"feedback-only / oracle = {gain_ratio(base_acc, champion_acc, oracle_acc):.2f}"
            )
        for exchange in drive(gateway, cfg.serving.model_name, 3, seed=2024, concurrency=1, api_key=key):
            console.print(f"Q: {exchange.question}\nA: {exchange.answer!r}  ({'right' if exchange.correct else 'wrong'}, trace {exchange.trace_id})")
        plot = cfg.resolve(cfg.state_dir) / "demo-live-thumbs-up.png"
        plot_live_rates(rates, plot)
        console.print(f"plot: {plot}\ntotal time {time.monotonic() - started:.0f} s")
    finally:
        if not keep_up:
            for proc in procs.values():
                stack.stop_group(proc.pid)
            for service in reversed(stack.stack_services(cfg, Path("-"))):
                service.stop()
        else:
            console.print(f"left running; status page: {api}/ — stop with `hourglass down` and by ending the service and gateway processes")


if __name__ == "__main__":
    typer.run(main)
