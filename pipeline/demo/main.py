"""The main job on the embedded default, end to end on this machine: the served
model learns from what its users say, and nothing else.

1. bring the local stack up (Tansu broker, MLflow on SQLite, vLLM with SmolLM2);
2. start the always-on service and the gateway as their own processes;
3. drive traffic through the gateway with the official ``openai`` client
   (reasoning-gym arithmetic; feedback = each simulated user's thumbs up/down);
4. start each round through the ops API once a phase of traffic is in (the
   demo's config turns the scheduler off, so phases and rounds alternate), and
   print it: the reward model's held-out AUC, every candidate's gate value next
   to the champion's (per served model), the winner or why none won;
5. the canary: a round's winner serves a sticky share of the users as
   ``@challenger`` beside the champion (the first winner: beside the base
   model, which serves the users until a champion exists) while traffic keeps
   flowing; the demo prints the live evidence as it grows (feedback events and
   thumbs-up rate of each side, the always-valid interval) and the monitor's
   decision (promote or abort) with how long it took; then more traffic,
   served by the champion (the base while none was promoted). With the
   opt-in oracle (a commented block in ``deploy/demo.toml``), whose served
   model gets no users so its canary could never decide, the demo promotes
   the oracle's challenger by hand through the ops API after each round, with
   that reason recorded on the version;
6. the scoreboard: the users' live thumbs-up rate of each phase's traffic
   (from the reward buffer), greedy accuracy by the users' own check on fresh
   prompts for the base and the final champion, and the champion's gain over
   the base (with the oracle: its accuracy and gain too, no ratio: it is a
   reference, not an upper bound); the shipped regression suite's greedy score
   for the base and the final champion (forgetting = base - champion; target
   <= 0.05); a plot of the live rate;
7. below a rating rate of 1, the explicit-only line (:mod:`pipeline.demo.replay`): the run's rounds replayed
   on the same traffic with the implicit signals off, by a second service process with its own served model,
   and its final greedy accuracy printed beside the champion's, so what the implicit signals add is measured.

With ``--scenario calculator`` the users ask two-digit products through an app with a ``calculate`` tool
(:data:`pipeline.demo.traffic.CALCULATOR`): the same recipe, stack and scoreboard, with vLLM serving the ChatML
template with Hermes-style tools (:data:`TOOL_SERVING`); the greedy accuracy runs the same tool loop.

With ``--hostile-share F`` a share F of the requests comes from coordinated hostile
users (:class:`pipeline.demo.traffic.Hostile`: every answer rated with the inverted
verdict, no corrections) through plain API keys, one key posing as many users
(``--hostile-keys one``) or a key each (``many``). The users' live verdict, the
canaries' honest lines and the per-round greedy accuracy count honest users only;
the reward model's held-out AUC is the round's own, over all held-out votes,
hostile ones included (the demo cannot see the reward model's per-row scores).
``bench/poisoning.py`` runs this at several shares and reads these lines.

The candidates of ``hourglass`` see only the users' feedback (reward model,
KTO) and the gate uses no reference answer; the reference answers the traffic
carries feed only this scoreboard (and the oracle recipe, where it is on).

Run it with ``make demo`` (or ``python -m pipeline.demo --config deploy/demo.toml``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from enum import Enum
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from openai import OpenAI
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline import stack
from pipeline.cli.main import base_model_dir
from pipeline.cli.common import load
from pipeline.config import HourglassConfig
from pipeline.demo.board import (
    LiveRate,
    SuiteScore,
    explicit_only_line,
    forgetting_line,
    gains_line,
    live_rates,
    plot_live_rates,
    suite_score,
)
from pipeline.demo.replay import LiveRound, replay_explicit_only
from pipeline.demo.ops import get, promote_by_hand, served_name, spawn, start_round, wait_http, wait_round
from pipeline.demo.traffic import (
    ARITHMETIC,
    SCENARIOS,
    Behaviour,
    Exchange,
    Hostile,
    Scenario,
    create_demo_key,
    create_hostile,
    drive,
    hostile_users,
    is_correct,
)
from trainer.regression_config import RegressionSuiteConfig
from trainer.types import Prompt

console = Console(soft_wrap=True)
FRESH_PROMPTS = 48  # greedy accuracy is measured on this many fresh prompts (seed 999, never trained on)
ORACLE_MODEL = "hourglass-oracle"  # the oracle recipe's own served model (deploy/demo.toml)
CONCURRENCY = 8  # requests in flight at once, so vLLM batches them


def _greedy_accuracy(
    vllm_url: str, model: str, questions: list[tuple[str, str]], scenario: Scenario = ARITHMETIC
) -> float:
    """Share of greedy answers from ``model`` on ``questions`` that the users' check accepts, each a user turn of
    ``scenario`` sent to vLLM directly (with a tool: the forced call, the app's result, the answer).

    The requests go out 8 at a time so vLLM batches them."""
    client = OpenAI(base_url=f"{vllm_url}/v1", api_key="none", max_retries=2, timeout=300)

    def right(item: tuple[str, str]) -> bool:
        question, reference = item
        _, answer, _ = scenario.answer(client, model, [{"role": "user", "content": question}], temperature=0.0)
        return is_correct(answer, reference)

    with ThreadPoolExecutor(max_workers=8) as pool:
        return sum(pool.map(right, questions)) / len(questions)


SHIPPED_SUITE = RegressionSuiteConfig(name="reasoning", path="shipped:reasoning-gym-mix", check="short_answer")


def _suite_of(cfg: HourglassConfig) -> RegressionSuiteConfig:
    """The regression suite the scoreboard reports: the config's first suite of the served model (the
    demo's is the shipped one), else the shipped suite."""
    return next((s for s in cfg.rl.regression if s.applies_to(cfg.serving.model_name)), SHIPPED_SUITE)


def _suite_scores(vllm_url: str, models: dict[str, str], suite: RegressionSuiteConfig) -> dict[str, SuiteScore]:
    """Each model's greedy score on ``suite`` (label -> served name), answers from vLLM 8 at a time per model."""
    from trainer.evaluation.regression import load_suite, suite_check

    prompts, check = load_suite(suite), suite_check(suite)

    def answer(served: str, prompt: Prompt) -> str:
        response = httpx.post(
            f"{vllm_url}/v1/chat/completions",
            json={"model": served, "messages": prompt.messages, "max_tokens": suite.max_new_tokens, "temperature": 0.0},
            timeout=300,
        )
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"] or ""

    with ThreadPoolExecutor(max_workers=8 * len(models)) as pool:  # every model's prompts in flight together
        asked = {served: pool.map(partial(answer, served), prompts) for served in set(models.values())}
        answers = {served: dict(zip((p.prompt_id for p in prompts), got)) for served, got in asked.items()}
    return {
        label: suite_score(served, prompts, lambda p: answers[served][p.prompt_id], check)  # noqa: B023 (used now)
        for label, served in models.items()
    }


def _wait_serving(api: str, model: str, version: str | None, timeout_s: float = 60.0) -> dict[str, Any]:
    """The service's serving status for ``model`` once it serves ``version`` (hot-loads run after the round ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        serving = get(f"{api}/status").get("serving", {}).get(model, {})
        if version is None or str(serving.get("serving")) == version or time.monotonic() > deadline:
            return serving
        time.sleep(0.5)


def _canary_look(api: str, model: str) -> dict[str, Any]:
    """The service's last canary look at ``model`` (``/status``: ``canary`` = running, ``last_canary`` = last decided)."""
    return get(f"{api}/status").get("canary", {}).get(model) or {}


def _sides(view: dict[str, Any]) -> str:
    """'challenger n events, r up vs champion n events, r up' of a canary view ('base' instead of
    'champion' when the model had no champion and the base served the other side)."""

    rate = view.get("metric", "thumbs_up_rate") == "thumbs_up_rate"  # else implicit signals count: a mean reward

    def side(name: str, label: str) -> str:
        arm = view.get(name) or {}
        n, mean = arm.get("n", 0), arm.get("mean")
        value = "-" if not n or mean is None else f"{mean:.0%} thumbs-up" if rate else f"mean reward {mean:+.2f}"
        return f"{label} {n} feedback events, {value}"

    return f"{side('challenger', 'challenger')} vs {side('champion', _control(view))}"


def _control(view: dict[str, Any]) -> str:
    """What the challenger is compared with: 'champion', or 'base' (the model had no champion yet)."""
    return "base" if view.get("control") == "base" else "champion"


def _interval(view: dict[str, Any]) -> str:
    lower, upper = view.get("lower"), view.get("upper")
    return "-" if lower is None or upper is None else f"[{lower:+.2f}, {upper:+.2f}]"


def _run_canary(
    api: str,
    gateway: str,
    cfg: HourglassConfig,
    key: str,
    version: str,
    seed: int,
    timeout_s: float,
    behaviour: Behaviour = Behaviour(),
    hostile: Hostile | None = None,
    scenario: Scenario = ARITHMETIC,
) -> tuple[list[Exchange], dict | None]:
    """Keep the users' traffic flowing while ``version`` is on canary, printing the live evidence after each
    batch, until the service's canary monitor decided (promote or abort) or ``timeout_s`` passed.

    Returns the canary phase's exchanges and the decided view (evidence, decision, reason, ``elapsed_s``), or
    None when no decision came in time."""
    model, canary = cfg.serving.model_name, cfg.serving.canary
    started = time.monotonic()
    serving: dict[str, Any] = {}
    while time.monotonic() - started < 120:  # the serving controller stages, loads and probes it first
        serving = _wait_serving(api, model, None)
        if (serving.get("challenger") or {}).get("served_name"):
            break
        time.sleep(1)
    other = "champion" if serving.get("desired") else "base"  # no champion yet: the base serves the other users
    beside = "the champion" if other == "champion" else "the base model (no champion yet)"
    console.print(
        f"canary: {model} v{version} serves {canary.fraction:.0%} of the users (sticky per user) beside {beside}, "
        f"{time.monotonic() - started:.0f} s after the round; decision rule: promote when both sides have "
        f"{canary.min_feedback} feedback events and the {1 - canary.alpha:.0%} always-valid interval of "
        f"(challenger - {other}) thumbs-up rate (mean reward where implicit signals count) is above "
        f"-{canary.margin:g}; "
        "abort when it is below 0 "
        f"or after {canary.max_duration_s:g} s"
    )
    sent: list[Exchange] = []
    batch = 0
    while time.monotonic() - started < timeout_s:
        look = _canary_look(api, model)
        last = look.get("last_canary") or {}
        if str(last.get("version")) == version and last.get("decision") in ("promote", "abort"):
            return sent, last
        view = look.get("canary") or {}
        if str(view.get("version")) == version and view.get("challenger"):
            console.print(
                f"  [dim]{time.monotonic() - started:4.0f} s  {_sides(view)}; interval {_interval(view)}: {view.get('decision')}[/]"
            )
        sent += drive(
            gateway,
            model,
            16,
            seed=seed * 1000 + batch,
            concurrency=CONCURRENCY,
            api_key=key,
            behaviour=behaviour,
            hostile=hostile,
            scenario=scenario,
        )
        batch += 1
    return sent, None


def _print_canary(version: str, decided: dict | None, sent: list[Exchange], took_s: float) -> str:
    """The canary's outcome; returns a one-line summary for the scoreboard."""
    if decided is None:
        line = f"v{version}: no decision within the demo's wait ({len(sent)} requests, {took_s:.0f} s); still on canary"
        console.print(f"[bold yellow]canary {line}[/]")
        return line
    word = "PROMOTED" if decided["decision"] == "promote" else "ABORTED"
    line = (
        f"v{version} {word} after {decided.get('elapsed_s', float('nan')):.0f} s of canary traffic "
        f"({took_s:.0f} s after the round, {len(sent)} requests): {_sides(decided)}; interval {_interval(decided)}"
    )
    console.print(f"[bold]canary {line}[/]\n  reason: {escape(str(decided.get('reason')))}")
    return line


ORACLE_REASON = "the oracle serves no users, so no live evidence can decide its canary; a reference for the scoreboard"


def _promote_oracle(api: str, token: str) -> None:
    """The oracle serves no users: its challenger is promoted by hand (:func:`pipeline.demo.ops.promote_by_hand`)."""
    version = promote_by_hand(api, token, ORACLE_MODEL, ORACLE_REASON)
    if version is not None:
        console.print(
            f"{ORACLE_MODEL} v{version} promoted by hand (a reference for the scoreboard, it serves no users)"
        )


def _live_verdict(
    cfg: HourglassConfig, phases: list[list[str]], verdicts: dict[str, bool] | None = None, timeout_s: float = 60.0
) -> list[LiveRate]:
    """The users' verdict per phase from the reward buffer, once every sent trace (and, without ``verdicts``,
    its feedback) has landed there (or ``timeout_s``). ``verdicts``: trace id -> right by the users' own check,
    for traffic where users rate only some answers."""
    from connectors.buffer import RewardBuffer

    sent = sum(len(p) for p in phases)
    deadline = time.monotonic() + timeout_s
    while True:
        rates = live_rates(RewardBuffer(cfg.buffer).snapshot(), phases, verdicts)
        if sum(r.rated for r in rates) >= sent or time.monotonic() > deadline:
            return rates
        time.sleep(2)


def _say_sent(exchanges: list[Exchange], what: str) -> None:
    """How many requests went out and what the users made of them (hostile users' requests counted apart)."""
    bad = [e for e in exchanges if e.hostile]
    honest = [e for e in exchanges if not e.hostile]
    if bad:
        what += f" ({len(bad)} from hostile users, {sum(not e.correct for e in bad)} wrong answers voted up)"
    right, who = sum(e.correct for e in honest), "honest users" if bad else "users"
    if all(e.action == "" for e in honest):
        console.print(f"{len(exchanges)} {what}; {who} gave {right} thumbs up")
        return
    actions = Counter(e.action for e in honest)
    console.print(
        f"{len(exchanges)} {what}; {right} right by the {who}' check, {sum(e.rated for e in honest)} rated; "
        f"then the {who} " + ", ".join(f"{a} {actions[a]}" for a in ("continued", "rephrased", "regenerated", "left"))
    )


def _num(value: Any, spec: str = ".3f") -> str:
    """A number from a round record as text; the API sends NaN as null, shown as '-'."""
    return "-" if value is None or value != value else format(value, spec)


AUC_NOTE = " (over all held-out votes, hostile ones included)"


def _print_round(record: dict[str, Any], sent: int, buffer: dict[str, Any], hostile: bool = False) -> None:
    """One round: the reward model's held-out AUC (the round's own: with ``hostile`` users, their votes are among
    the held-out labels, and the line says so), then per served model the gate values and the verdict."""
    metrics = record.get("metrics") or {}
    console.print(
        f"traces sent {sent}, in the buffer {buffer.get('trace_rows')}; round state [bold]{record['state']}[/]; "
        f"reward model held-out AUC {_num(metrics.get('reward_model/auc'))}{AUC_NOTE if hostile else ''}"
    )
    for model, decision in (record.get("decisions") or {}).items():
        table = Table(f"{model}: candidate", f"gate value ({decision.get('metric', '-')})", "lower bound vs champion")
        table.add_row("champion", _num(decision.get("champion_reward")), "")
        for name, value in (decision.get("candidate_rewards") or {}).items():
            table.add_row(name, _num(value), _num((decision.get("lower_bounds") or {}).get(name), "+.3f"))
        console.print(table)
        console.print(
            f"{model}: winner {decision.get('winner') or 'none'}; gate: {escape(decision.get('reason', '-'))}"
        )
    for name, why in (record.get("skipped") or {}).items():
        console.print(f"candidate {name} sat this round out: {escape(why)}")


def honest_canary_line(i: int, rate: LiveRate, version: str, decision: str | None) -> str:
    """The honest users' verdict on both sides of round ``i``'s canary of ``version``, from its traffic's
    :class:`LiveRate` (served by the challenger, and by the replaced side: the champion or the base), and the
    monitor's ``decision`` (promote, abort, None: undecided). ``bench/poisoning.py`` parses this line."""

    def side(up: int, n: int) -> str:
        return f"{up}/{n} ({up / n:.0%})" if n else "0/0 (-)"

    up, n = rate.served_by.get(version, (0, 0))
    others = {v: c for v, c in rate.served_by.items() if v != version}
    replaced = "+".join(v if v == "base" else f"v{v}" for v in others) or "-"
    outcome = {"promote": "PROMOTED", "abort": "ABORTED"}.get(decision or "", "undecided")
    return (
        f"canary of round {i}, honest users only: challenger v{version} {side(up, n)}, replaced side {replaced} "
        f"{side(sum(c[0] for c in others.values()), sum(c[1] for c in others.values()))}; {outcome}"
    )


def _print_scoreboard(
    rates: list[LiveRate],
    canaries: dict[int, tuple[LiveRate, str]],
    accuracy: dict[str, float],
    aucs: list[float | None],
    judged: bool = False,
    honest: Sequence[str] = (),
    by_round: Sequence[float] = (),
    hostile: bool = False,
) -> None:
    """The users' live verdict per phase (canary traffic on rows of its own), greedy accuracy, AUC by round.
    ``judged``: the verdict is the users' own check of every answer (they rated only some), not their thumbs.
    ``honest``: each canary's :func:`honest_canary_line`. ``by_round``: greedy accuracy of the served model after
    each round. ``hostile``: there were hostile users, left out of the live verdict (the title says so); the
    AUC line says it includes their votes."""
    word = "right" if judged else "thumbs-up"
    live = Table(
        "phase",
        f"served by (version: {'right/answered' if judged else 'up/rated'})",
        "users' check: right" if judged else "users' thumbs-up",
        "rate",
        title="The honest users' live verdict (hostile users left out)" if hostile else "The users' live verdict",
    )

    def row(label: str, r: LiveRate) -> None:
        served = ", ".join(f"{v}: {u}/{n}" for v, (u, n) in r.served_by.items()) or "-"
        live.add_row(label, served, f"{r.up}/{r.rated}", f"{r.rate:.0%}" if r.rated else "-")

    for r in rates:
        if r.phase in canaries:
            row(f"canary of round {r.phase}", canaries[r.phase][0])
        row("before round 1" if r.phase == 0 else f"after round {r.phase}", r)
    console.print(live)
    if rates and rates[0].rated and rates[-1].rated and rates[0].rate > 0:
        console.print(f"last phase / first phase {word} rate: {rates[-1].rate / rates[0].rate:.1f}x")
    for i, (_, line) in sorted(canaries.items()):
        console.print(f"canary of round {i}: {line}")
    for line in honest:
        console.print(line)
    greedy = Table(
        "model", f"greedy accuracy by the users' check ({FRESH_PROMPTS} fresh prompts)", title="Fresh prompts"
    )
    for label, value in accuracy.items():
        greedy.add_row(label, f"{value:.3f}")
    console.print(greedy)
    if by_round:
        console.print(
            f"greedy accuracy of the served model by round ({FRESH_PROMPTS} fresh prompts): "
            + ", ".join(f"{a:.3f}" for a in by_round)
        )
    console.print(
        "reward model held-out AUC by round: " + ", ".join(_num(a) for a in aucs) + (AUC_NOTE if hostile else "")
    )


class ScenarioName(str, Enum):
    """What the simulated users ask: one-digit additions (``arithmetic``), or two-digit products through an app
    that makes the model call its ``calculate`` tool first (``calculator``)."""

    arithmetic = "arithmetic"
    calculator = "calculator"


# The calculator scenario's serving settings, set in the environment (a value already there wins) before the
# config is read, so the stack and the service's processes get them: the ChatML template with Hermes-style tools
# (it renders tool-free chats exactly as SmolLM2's own) and vLLM's parser for its calls. The recipe is the same.
TOOL_SERVING = {"HOURGLASS_MODEL__CHAT_TEMPLATE": "chatml-tools", "HOURGLASS_SERVING__TOOL_CALL_PARSER": "hermes"}


class HostileKeys(str, Enum):
    """How the hostile users reach the gateway: ``one`` API key posing as a fresh user per request, or ``many``
    keys, one per hostile user."""

    one = "one"
    many = "many"


DEMO_MARKER = "hourglass-demo-state"  # written into a state folder the demo made, so only such a folder is wiped


def _fresh_state(cfg: HourglassConfig) -> None:
    """Start from nothing: a previous demo's state folder (its registry, champion, routes, buffer, MLflow) is
    removed after stopping whatever of its stack still runs, so "before round 1" is served by the base and
    every figure is this run's. Only a folder the demo made (it holds :data:`DEMO_MARKER`) is removed.

    Raises:
        typer.BadParameter: the state folder holds files the demo did not make (a service's state:
            ``--config`` names another deployment's), or a previous ``--keep-up`` demo still serves the ops
            API or the gateway.
    """
    state = cfg.resolve(cfg.state_dir)
    if state.exists() and any(state.iterdir()):
        if not (state / DEMO_MARKER).exists():
            raise typer.BadParameter(
                f"state_dir {state} holds files the demo did not make; the demo starts from an empty state folder "
                "and removes only its own: remove it (`make clean` for .hourglass) or point state_dir at a new folder",
                param_hint="--config",
            )
        for port in (cfg.api.port, cfg.api.gateway_port):
            if not stack.port_is_free("127.0.0.1", port):
                raise typer.BadParameter(
                    f"port {port} is in use (a demo left running with --keep-up?): stop its service and gateway first",
                    param_hint="--config",
                )
        for service in reversed(stack.stack_services(cfg, Path("-"))):
            service.stop()
        shutil.rmtree(state)
        console.print(f"removed the previous demo's state ({state}): this run starts from the base")
    state.mkdir(parents=True, exist_ok=True)
    (state / DEMO_MARKER).write_text("made by python -m pipeline.demo; removed by its next run\n")


def main(
    config: Annotated[Path, typer.Option("--config", "-c")] = Path("deploy/demo.toml"),
    rounds: Annotated[int, typer.Option(min=1, help="Rounds to run.")] = 4,
    traffic: Annotated[int, typer.Option(min=1, help="Requests before the first round.")] = 192,
    between: Annotated[
        int, typer.Option(min=1, help="Requests after each round (and its canary), served by the champion.")
    ] = 96,
    canary_wait: Annotated[
        float,
        typer.Option(min=0.0, help="Longest wait for a canary decision, seconds (traffic keeps flowing meanwhile)."),
    ] = 660.0,
    keep_up: Annotated[bool, typer.Option(help="Leave the stack, service and gateway running.")] = False,
    rating_rate: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Share of answers the users rate explicitly. Below 1 they otherwise only behave, in multi-turn "
            "chats (go on, restate, regenerate, leave): the implicit signals.",
        ),
    ] = 1.0,
    contradiction: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of the users' behaviour that contradicts their verdict.")
    ] = 0.2,
    hostile_share: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=0.5,
            help="Share of the requests sent by coordinated hostile users: they rate every answer with the inverted "
            "verdict and never correct. 0: none.",
        ),
    ] = 0.0,
    hostile_keys: Annotated[
        HostileKeys,
        typer.Option(
            help="one: all hostile traffic through one plain API key, a fresh user per request; many: one key and "
            "one user per hostile user (share x 16 of them, at least 1)."
        ),
    ] = HostileKeys.one,
    scenario: Annotated[
        ScenarioName,
        typer.Option(help="arithmetic: one-digit additions; calculator: two-digit products through a calculator tool."),
    ] = ScenarioName.arithmetic,
    explicit_line: Annotated[
        bool,
        typer.Option(
            help="Below a rating rate of 1: after the scoreboard, replay the run's rounds on the same traffic with "
            "the implicit signals off, and print that explicit-only line's greedy accuracy beside the champion's.",
        ),
    ] = True,
    seed: Annotated[
        int,
        typer.Option(
            min=0,
            help="Shifts every traffic seed by 10 000 x SEED (questions, users, hostile draws); the fresh prompts of "
            "the greedy accuracy stay the same. 0: the default traffic.",
        ),
    ] = 0,
) -> None:
    """Run the whole loop on the embedded default and show it improve."""
    from pipeline.state_secrets import api_token

    started = time.monotonic()
    behaviour = Behaviour(rating_rate=rating_rate, contradiction=contradiction)
    verdicts: dict[str, bool] = {}  # trace id -> right by the users' own check
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below on SIGTERM too
    task = SCENARIOS[scenario.value]
    if task.tool is not None:
        for name, value in TOOL_SERVING.items():
            os.environ.setdefault(name, value)
    cfg = load(config)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    console.rule("1. local stack")
    _fresh_state(cfg)
    services = stack.stack_services(cfg, base_model_dir(cfg))
    for service in services:
        for attempt in range(3):  # a busy host may lack the memory for vLLM's KV cache for a while
            if stack.running_pid(service) and service.health():
                break
            console.print(f"starting {service.name} ...")
            try:
                service.start()
            except stack.StackError as err:
                if attempt == 2:
                    raise
                console.print(f"[yellow]{service.name} did not start ({escape(str(err))}); again in 30 s[/]")
                time.sleep(30)
        console.print(f"{service.name}: healthy on {service.host}:{service.port}")
    watching = (
        threading.Event()
    )  # like `hourglass up --watch`: a stack process that dies (e.g. the OOM killer) is started again
    threading.Thread(target=stack.watch, args=(services, watching), daemon=True, name="demo-watch").start()
    from connectors.kafka_admin import ensure_topics

    ensure_topics(cfg.kafka)
    api, gateway = f"http://127.0.0.1:{cfg.api.port}", f"http://127.0.0.1:{cfg.api.gateway_port}"
    vllm_url, model = cfg.serving.replicas[0], cfg.serving.model_name
    key = create_demo_key(cfg.resolve(cfg.state_dir))  # trusted grader: the simulated users send reference answers
    hostile = create_hostile(cfg.resolve(cfg.state_dir), hostile_share, hostile_keys.value)  # plain keys
    if hostile is not None:
        who = (
            "one plain API key posing as a fresh user per request"
            if hostile.mode == "one"
            else f"{hostile_users(hostile_share)} hostile users, each with its own plain API key and user"
        )
        console.print(
            f"hostile users: share {hostile_share:g} of the requests, mode {hostile.mode} ({who}); coordinated: every "
            "answer rated with the inverted verdict, no corrections. The live verdict, the canaries' honest lines and "
            "the greedy accuracy count honest users only; the reward model's AUC includes the hostile votes."
        )
    procs = {
        "service": spawn("service", ["service"], cfg, config),
        "gateway": spawn("gateway", ["gateway"], cfg, config),
    }
    try:
        wait_http(f"{api}/healthz", "the service", procs["service"])
        wait_http(f"{gateway}/healthz", "the gateway", procs["gateway"])
        token = api_token(cfg)  # the ops API's token (written by the service at start)
        console.print(f"service (ops API) on {api}, gateway on {gateway}; status page: {api}/")

        console.rule("2. traffic through the gateway")
        if task.tool is not None:
            console.print(
                f"scenario {task.name}: two-digit products; each user turn is a forced `calculate` call, the app "
                "running it, and the answer the user sees (counts below are user turns)"
            )
        questions = task.questions(FRESH_PROMPTS, 999)  # fresh prompts, never seen in training
        by_round: list[float] = []
        live_rounds: list[LiveRound] = []  # for the explicit-only line's replay
        measured: dict[str, float] = {}  # served name (one version's weights) -> its greedy accuracy

        def greedy(served: str) -> float:
            """``served``'s greedy accuracy on ``questions``, measured once: the scoreboard's champion and base
            are usually a round's served model already; its prompts share vLLM's batches with a phase's traffic."""
            if served not in measured:
                measured[served] = _greedy_accuracy(vllm_url, served, questions, task)
            return measured[served]

        with ThreadPoolExecutor(max_workers=1) as check:
            base_checked = check.submit(greedy, cfg.serving.base_served_name)  # the base's, for the scoreboard
            exchanges = drive(
                gateway,
                model,
                traffic,
                seed=1 + 10_000 * seed,
                concurrency=CONCURRENCY,
                api_key=key,
                behaviour=behaviour,
                hostile=hostile,
                scenario=task,
            )
            base_checked.result()  # its error, if any, now
        verdicts |= {e.trace_id: e.correct for e in exchanges}
        _say_sent(exchanges, "requests (served by the base)")
        phases: list[list[str]] = [[e.trace_id for e in exchanges if not e.hostile]]  # honest users' traces only
        canaries: dict[int, list[str]] = {}
        canary_lines: dict[int, str] = {}
        canary_of: dict[int, tuple[str, str | None]] = {}  # round -> (version, decision)
        aucs: list[float | None] = []
        for i in range(1, rounds + 1):
            console.rule(f"3.{i} round {i}")
            started_at = datetime.now(timezone.utc)  # the phase's traffic is in: the window a replay reads ends here
            record = wait_round(api, start_round(api, token), timeout_s=1800)
            rows = (record.get("metrics") or {}).get("data/rows")
            live_rounds.append(LiveRound(started_at, int(rows) if rows is not None else None))
            sent = len(verdicts)  # every trace sent so far, hostile ones included
            _print_round(record, sent, get(f"{api}/buffer/stats"), hostile=hostile is not None)
            aucs.append((record.get("metrics") or {}).get("reward_model/auc"))
            console.print(f"round: {escape(record['reason'])}")
            _promote_oracle(api, token)
            version = str((record.get("versions") or {}).get(model) or "")
            undecided = False  # a canary still running may retire the served model during the next phase
            promoted = None  # the version a canary promoted: the next phase and its accuracy are that version's
            if version and f"{model} v{version} on canary" in (record.get("reason") or ""):
                ended = time.monotonic()
                more, decided = _run_canary(
                    api,
                    gateway,
                    cfg,
                    key,
                    version,
                    seed=100 + i + 10_000 * seed,
                    timeout_s=canary_wait,
                    behaviour=behaviour,
                    hostile=hostile,
                    scenario=task,
                )
                verdicts |= {e.trace_id: e.correct for e in more}
                canaries[i] = [e.trace_id for e in more if not e.hostile]
                canary_of[i] = (version, decided["decision"] if decided else None)
                promoted = version if decided and decided["decision"] == "promote" else None
                undecided = decided is None
                canary_lines[i] = _print_canary(version, decided, more, time.monotonic() - ended)
                time.sleep(
                    2 * cfg.serving.reconcile_interval_s
                )  # the route drops the challenger (promote: moves to it)
            serving = _wait_serving(api, model, promoted)  # the route moves on the service's next reconcile
            if promoted and str(serving.get("serving")) != promoted:
                console.print(
                    f"[yellow]v{promoted} was promoted but does not serve yet: the next phase may not be its own[/]"
                )
            hotload = serving.get("last_hotload_s")
            console.print(
                f"serving now: {model} -> {serving.get('serving') or 'the base (no champion)'}   last hot-load: {f'{hotload:.2f}' if hotload is not None else '-'} s"
            )
            served_now = served_name(cfg, model) or cfg.serving.base_served_name
            with ThreadPoolExecutor(max_workers=1) as check:
                accuracy_now = check.submit(greedy, served_now)
                if undecided:  # measured before the phase, while served_now still serves
                    accuracy_now.result()
                more = drive(  # the phase after round i, served by its champion
                    gateway,
                    model,
                    between,
                    seed=200 + i + 10_000 * seed,
                    concurrency=CONCURRENCY,
                    api_key=key,
                    behaviour=behaviour,
                    hostile=hostile,
                    scenario=task,
                )
                by_round.append(accuracy_now.result())
            console.print(f"greedy accuracy after round {i} ({served_now}): {by_round[-1]:.3f}")
            verdicts |= {e.trace_id: e.correct for e in more}
            phases.append([e.trace_id for e in more if not e.hostile])
            _say_sent(more, "more requests")

        console.rule("4. the scoreboard")
        time.sleep(cfg.serving.reconcile_interval_s)  # let the reconcile loop settle the last promotion
        routes_file = cfg.resolve(cfg.state_dir) / "routes.json"
        routes = json.loads(routes_file.read_text()) if routes_file.exists() else {}
        accuracy = {f"base ({cfg.serving.base_served_name})": greedy(cfg.serving.base_served_name)}
        on_suite = {"base": cfg.serving.base_served_name}
        gains: dict[str, float | None] = {"champion": None, "oracle": None}
        for label, served_model in [("champion", model), ("oracle", ORACLE_MODEL)]:
            route = routes.get(served_model, {})
            served = route.get("served_name")
            if served and route.get("version"):  # a route without a version is the base (a canary with no champion)
                accuracy[f"{label} ({served})"] = gains[label] = greedy(served)
                if label == "champion":
                    on_suite["champion"] = served
        suite = _suite_of(cfg)
        suite_scores = _suite_scores(vllm_url, on_suite, suite)
        canary_ids = sorted(canaries)
        all_rates = _live_verdict(
            cfg, phases + [canaries[i] for i in canary_ids], verdicts if behaviour.conversational else None
        )
        rates = all_rates[: len(phases)]
        canary_rates = {i: (r, canary_lines[i]) for i, r in zip(canary_ids, all_rates[len(phases) :])}
        honest = [honest_canary_line(i, canary_rates[i][0], *canary_of[i]) for i in canary_ids]
        _print_scoreboard(
            rates,
            canary_rates,
            accuracy,
            aucs,
            judged=behaviour.conversational,
            honest=honest,
            by_round=by_round,
            hostile=hostile is not None,
        )
        console.print(gains_line(next(iter(accuracy.values())), gains["champion"], gains["oracle"]))
        console.print(forgetting_line(suite.name, suite_scores["base"], suite_scores.get("champion")))
        for exchange in drive(gateway, model, 3, seed=2024, concurrency=1, api_key=key, scenario=task):
            console.print(
                f"Q: {exchange.question}\nA: {exchange.answer!r}  ({'right' if exchange.correct else 'wrong'}, trace {exchange.trace_id})"
            )
        if behaviour.conversational and explicit_line:
            console.rule("5. the explicit-only line: the same traffic, its explicit ratings alone")
            stack.stop_group(procs.pop("service").pid)  # the replay's service takes the ops API's port
            names = [c.name for c in cfg.candidates if c.served_model == model]
            replayed, final = replay_explicit_only(cfg, config, live_rounds, names, procs)
            explicit = greedy(final or cfg.serving.base_served_name)
            console.print(
                explicit_only_line(
                    next(iter(accuracy.values())), gains["champion"], explicit, final, rating_rate, len(replayed)
                )
            )
        plot = cfg.resolve(cfg.state_dir) / "demo-live-thumbs-up.png"
        plot_live_rates(rates, plot)
        loadavg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        console.print(
            f"plot: {plot}\ntotal time {time.monotonic() - started:.0f} s on {os.cpu_count()} CPUs; load average (1, 5, 15 min) {loadavg}"
        )
    finally:
        watching.set()
        if not keep_up:
            for proc in procs.values():
                stack.stop_group(proc.pid)
            for service in reversed(stack.stack_services(cfg, Path("-"))):
                service.stop()
        else:
            console.print(
                f"left running; status page: {api}/ — stop with `hourglass down` and by ending the service and gateway processes"
            )


if __name__ == "__main__":
    typer.run(main)
