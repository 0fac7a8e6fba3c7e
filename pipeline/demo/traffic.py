"""Simulated users: verifiable questions sent through the gateway with the
official ``openai`` client, answers checked as a user would, feedback posted.

Prompts come from reasoning-gym (procedural arithmetic). The user's feedback
is a thumbs up when the answer is right and a thumbs down otherwise, sent with
the API key and the response's feedback token; half of the users (the even
ones, :data:`EDITING_USERS`) also edit a wrong answer into the right number,
sent as the feedback's ``correction``.

By default every user rates every answer and each exchange is one turn. With a
:class:`Behaviour` whose ``rating_rate`` is below 1, users rate only that share of
answers and otherwise just behave, in multi-turn chats: after a right answer
they go on with their next question in the same chat (or leave), after a wrong
one they restate the question, ask for another answer (the same messages
again) or leave, and a ``contradiction`` share of their behaviour goes against
their own verdict. The gateway links the turns and each snapshot derives the
implicit signals (``continued``, ``rephrased``, ``regenerated``) from them:
:mod:`connectors.implicit`. Each request also carries the reference answer in
``metadata``, for the demo's own scoreboard and its oracle recipe
(``first_number_answer``, the users' own check as a reward); the gateway keeps
it as a label only from a trusted-grader key (:func:`create_demo_key` makes
one). Each simulated user sends its own ``user`` id, so per-user caps see
several users.

The :data:`CALCULATOR` scenario (the demo's ``--scenario calculator``) asks two-digit products through an app
with a ``calculate`` tool instead: each user turn is two requests, the first forcing the tool call (``tool_choice``
naming the function: SmolLM2-135M never calls a tool on its own, ``bench/tool_calling.py``), the app running the
call on the model's expression (:func:`calculate`) and sending the result back, the second the answer the user sees
and judges. What the model must learn is the expression; the implicit signals reach the tool-call turn through the
answer its result led to (:mod:`connectors.implicit`).

With :class:`Hostile` users (the demo's ``--hostile-share``), a share of the
requests comes from coordinated hostile users instead: they rate every answer
with the inverted verdict (thumbs up when wrong by the users' check, down when
right), never send a correction, and (conversational) act as satisfied when the
answer is wrong. They use plain API keys (not trusted graders): either one key
posing as a fresh ``user`` per request (or chat), or one key and one stable
``user`` per hostile user. Their exchanges are marked ``hostile``, so the
demo's scoreboard counts honest users only.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import httpx
from openai import APIConnectionError, InternalServerError, OpenAI, RateLimitError
from tenacity import RetryCallState, retry, retry_if_exception, retry_if_exception_type, stop_after_delay

from connectors.gateway.auth import KeyStore
from trainer.rewards import first_number_answer
from trainer.tasks import reasoning_gym_prompts

_F = TypeVar("_F", bound=Callable[..., Any])
FEEDBACK_HEADER = "x-hourglass-feedback-token"
SIMULATED_USERS = 16
EDITING_USERS = frozenset(f"sim-user-{i}" for i in range(0, SIMULATED_USERS, 2))  # they correct wrong answers


# A next question in the same chat is just the sum ("5 + 9?"): the implicit signals tell a rephrase from going on
# by the word-set similarity of the two user messages, so a template shared by both ("What about ...?") would make
# every next question look like a restatement (a known failure mode of that measure: docs/data-contracts.md).
FOLLOW_UP = "{q}?"
RETRY = "Wrong. "  # an unsatisfied user restates their last message with this in front
Message = dict[str, Any]
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION_CHARS = 64


def calculate(expression: Any) -> str:
    """The calculator app's tool: the value of a short arithmetic expression (numbers, ``+ - * /``, parentheses,
    unary minus) as text, or ``{"error": ...}`` JSON for anything else (the ``tool_error`` signal reads it).
    Exact (fractions, never a float's rounding: ``99999999999999999999/3`` is ``33333333333333333333``); an
    infinite or NaN literal (``1e309``) is an error."""

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return Fraction(node.value)  # OverflowError / ValueError for inf and nan
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    if not isinstance(expression, str) or not 0 < len(expression) <= MAX_EXPRESSION_CHARS:
        return json.dumps({"error": f"expression must be text of 1 to {MAX_EXPRESSION_CHARS} characters"})
    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, MemoryError) as err:
        return json.dumps({"error": f"cannot evaluate {expression!r}: {type(err).__name__}"})
    return str(result.numerator) if result.denominator == 1 else f"{float(result):.6g}"


CALCULATE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression, e.g. 12 * 34.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        "strict": True,  # vLLM holds the arguments to the schema: the model chooses only the expression
    },
}


@dataclass(frozen=True)
class Scenario:
    """What the simulated users ask, how a next question in the same chat reads, and the tool (if any) the app
    offers and forces on each user turn."""

    name: str
    task: str  # the traces' metadata.task
    questions: Callable[[int, int], list[tuple[str, str]]]  # (n, seed) -> (question, reference answer)
    follow_up: Callable[[str], str]  # a next question in the same chat, from the question as first asked
    tool: dict[str, Any] | None = None

    def answer(
        self,
        client: OpenAI,
        model: str,
        messages: Sequence[Message],
        *,
        temperature: float,
        max_tokens: int = 16,
        **extra: Any,
    ) -> tuple[Any, str, list[Message]]:
        """One user turn: (the raw response of the answer the user sees, its text, the messages it answered).
        With a tool: the call is forced, the app runs it and sends the result back, then the answer comes."""
        if self.tool is None:
            raw = _create(client, model, list(messages), max_tokens, temperature, **extra)
            return raw, raw.parse().choices[0].message.content or "", list(messages)
        tools = {"tools": [self.tool], **extra}
        forced = {"type": "function", "function": {"name": self.tool["function"]["name"]}}
        raw = _create(client, model, list(messages), 48, temperature, tool_choice=forced, **tools)
        message = raw.parse().choices[0].message
        if not message.tool_calls:  # cut short before the call closed (max_tokens): the text is the answer
            return raw, message.content or "", list(messages)
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]
        shown = [*messages, {"role": "assistant", "content": message.content, "tool_calls": calls}]
        shown += [{"role": "tool", "tool_call_id": c["id"], "content": _run_call(c)} for c in calls]
        raw = _create(client, model, shown, max_tokens, temperature, tool_choice="none", **tools)
        return raw, raw.parse().choices[0].message.content or "", shown


def _create(
    client: OpenAI, model: str, messages: list[Message], max_tokens: int, temperature: float, **extra: Any
) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=temperature,
        **extra,
    )


def _run_call(call: Any) -> str:
    """The app runs one ``calculate`` call on the model's arguments (JSON text, as the API sends them)."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments else {}
    except (ValueError, RecursionError):
        return json.dumps({"error": "arguments are not JSON"})
    return calculate(parsed.get("expression") if isinstance(parsed, dict) else None)


@dataclass(frozen=True)
class Behaviour:
    """How the simulated users act on an answer (see the module docstring)."""

    rating_rate: float = 1.0  # share of answers rated explicitly (thumbs, and corrections from editing users)
    contradiction: float = 0.2  # share of behaviour that goes against the user's own verdict
    go_on: float = 0.85  # a satisfied user asks the next question in the same chat; else leaves
    rephrase: float = 0.5  # an unsatisfied user restates the question ...
    regenerate: float = 0.3  # ... or asks for another answer; else (the rest) leaves
    max_turns: int = 4  # requests in one chat before the user leaves

    @property
    def conversational(self) -> bool:
        """Users behave in multi-turn chats (else: one rated turn per exchange, the demo's default)."""
        return self.rating_rate < 1.0


@dataclass(frozen=True)
class Exchange:
    """One request through the gateway and what the user made of it: ``correct`` by the users' own check,
    ``rated`` when they sent explicit feedback, ``action`` what they did next (conversational users:
    ``continued``, ``rephrased``, ``regenerated`` or ``left``; ``""`` for one-turn exchanges)."""

    trace_id: str
    question: str
    answer: str
    reference: str
    correct: bool
    rated: bool = True
    action: str = ""
    hostile: bool = False  # sent by a hostile user (:class:`Hostile`): its vote, if any, was inverted


@dataclass(frozen=True)
class Hostile:
    """Coordinated hostile users: each request of a :func:`drive` is theirs with probability ``share`` (a seeded
    draw per request, so reruns send the same), with ``keys`` as their API keys (plain keys, not trusted graders).

    ``mode`` ``one``: a single key poses as many users, a fresh ``user`` value per request (per chat when
    conversational), the attack the per-key cap (``max_key_share``) exists for; ``many``: one key and one
    stable ``user`` per hostile user."""

    share: float
    keys: tuple[str, ...]
    mode: Literal["one", "many"] = "one"

    def sender(self, seed: int, i: int) -> tuple[str, str] | None:
        """(API key, ``user``) of request ``i`` of the drive with ``seed`` when a hostile user sends it, else None."""
        if not self.keys or random.Random(f"hostile-{seed}-{i}").random() >= self.share:
            return None
        if self.mode == "one":
            return self.keys[0], f"user-{seed}-{i}"  # a fresh user value every time: nothing ties them but the key
        j = (seed * 7 + i) % len(self.keys)
        return self.keys[j], f"hostile-user-{j}"


def hostile_users(share: float) -> int:
    """How many hostile users mode ``many`` has at ``share``: ``share`` x :data:`SIMULATED_USERS`, at least 1."""
    return max(1, round(share * SIMULATED_USERS))


def create_hostile(state_dir: str | Path, share: float, mode: Literal["one", "many"]) -> Hostile | None:
    """The hostile users' plain API keys, created in the gateway's key store under ``state_dir``: one key (mode
    ``one``) or one per hostile user (``many``, :func:`hostile_users`). None when ``share`` is 0 (no key made).

    Raises:
        ValueError: ``share`` is not in [0, 1] or ``mode`` is neither ``one`` nor ``many``.
    """
    if not 0.0 <= share <= 1.0 or mode not in ("one", "many"):
        raise ValueError(f"hostile share must be in [0, 1] and mode one or many, got {share!r} and {mode!r}")
    if share == 0.0:
        return None
    store = KeyStore(Path(state_dir) / "gateway-keys.json")
    names = ["hostile"] if mode == "one" else [f"hostile-{j}" for j in range(hostile_users(share))]
    return Hostile(share, tuple(store.create(name)[1] for name in names), mode)


def is_correct(answer: str, reference: str) -> bool:
    """The first number in the answer equals the reference (what a user checks): the
    ``first_number_answer`` reward, so the oracle recipe trains on exactly this check."""
    return first_number_answer([], answer, {"reference_answer": reference}) == 1.0


def arithmetic_questions(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (question, reference answer) pairs of one-digit additions."""
    prompts = reasoning_gym_prompts(
        "basic_arithmetic",
        n,
        seed,
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=1,
        operators=("+",),
        allow_parentheses=False,
        allow_negation=False,
    )
    return [(p.messages[0]["content"], p.metadata["reference_answer"]) for p in prompts]


def product_questions(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (question, reference answer) pairs of two-digit products (the calculator scenario's questions)."""
    rng = random.Random(f"products-{seed}")
    pairs = [(rng.randint(11, 99), rng.randint(11, 99)) for _ in range(n)]
    return [(f"What is {a} * {b}?", str(a * b)) for a, b in pairs]


ARITHMETIC = Scenario(
    "arithmetic",
    "basic_arithmetic",
    arithmetic_questions,
    lambda q: FOLLOW_UP.format(q=q.split(".")[0].removeprefix("Calculate ")),
)
CALCULATOR = Scenario(
    "calculator",
    "calculator_products",
    product_questions,
    lambda q: "And " + q.removeprefix("What is "),  # "And 47 * 38?": no word shared with "What is 12 * 55?"
    tool=CALCULATE_TOOL,
)
SCENARIOS = {s.name: s for s in (ARITHMETIC, CALCULATOR)}


def create_demo_key(state_dir: str | Path, name: str = "demo") -> str:
    """A new trusted-grader API key in the gateway's key store under ``state_dir`` (the demo's simulated
    users send reference answers, which only a trusted grader may set); returns the key string."""
    _, key = KeyStore(Path(state_dir) / "gateway-keys.json").create(name, trusted_grader=True)
    return key


def _chat(
    client: OpenAI,
    model: str,
    messages: list[Message],
    reference: str,
    max_tokens: int,
    user: str | None,
    scenario: Scenario = ARITHMETIC,
) -> tuple[str, str, str, list[Message]]:
    """One user turn through the gateway: (trace id, answer, feedback token, the messages the answer answered:
    with a tool, the user's messages plus the call and its result)."""
    raw, answer, shown = scenario.answer(
        client,
        model,
        messages,
        temperature=0.7,
        max_tokens=max_tokens,
        extra_body={
            "metadata": {"reference_answer": reference, "task": scenario.task},
            **({"user": user} if user else {}),
        },
    )
    return raw.headers.get("x-hourglass-trace-id", ""), answer, raw.headers.get(FEEDBACK_HEADER, ""), shown


def _vote(
    client: OpenAI,
    gateway_url: str,
    trace_id: str,
    token: str,
    correct: bool,
    reference: str,
    user: str | None,
    hostile: bool = False,
) -> None:
    """The user's explicit feedback: thumbs by the users' check; from one of :data:`EDITING_USERS` a wrong
    answer's correction. A ``hostile`` user inverts the thumbs and never corrects."""
    vote = {"trace_id": trace_id, "thumbs": "up" if correct != hostile else "down", "feedback_token": token}
    if not correct and not hostile and user in EDITING_USERS:
        vote["correction"] = reference  # the user's edit: the answer they wanted
    headers = {"authorization": f"Bearer {client.api_key}"}
    _post_feedback(f"{gateway_url}/v1/feedback", vote, headers)


def _wait_s(state: RetryCallState) -> float:
    """Before asking again: a 429's ``Retry-After`` (1 to 30 s: the gateway's per-key rate limit), else 5 s (a
    model server that is away)."""
    response = getattr(state.outcome.exception() if state.outcome else None, "response", None)
    if response is not None and response.status_code == 429:
        try:
            return min(30.0, max(1.0, float(response.headers.get("retry-after", "1"))))
        except ValueError:
            return 1.0
    return 5.0


def _rate_limited(err: BaseException) -> bool:
    return isinstance(err, httpx.HTTPStatusError) and err.response.status_code == 429


@retry(retry=retry_if_exception(_rate_limited), wait=_wait_s, stop=stop_after_delay(600), reraise=True)
def _post_feedback(url: str, vote: dict, headers: dict[str, str]) -> None:
    """One feedback event; a 429 (the key's rate limit: a fast host's demo can send faster than it allows) is
    sent again after its ``Retry-After``, as a polite client does, for up to 10 minutes."""
    httpx.post(url, json=vote, headers=headers, timeout=30).raise_for_status()


def ask(
    client: OpenAI,
    gateway_url: str,
    model: str,
    question: str,
    reference: str,
    max_tokens: int = 16,
    *,
    user: str | None = None,
    hostile: bool = False,
    scenario: Scenario = ARITHMETIC,
) -> Exchange:
    """One user turn through the gateway (:meth:`Scenario.answer`), then the user's feedback on the answer they
    saw (same API key, the response's token): thumbs by the users' check, and from one of :data:`EDITING_USERS` a
    wrong answer's correction; a ``hostile`` user's thumbs inverted, never a correction."""
    messages: list[Message] = [{"role": "user", "content": question}]
    trace_id, answer, token, _ = _chat(client, model, messages, reference, max_tokens, user, scenario)
    correct = is_correct(answer, reference)
    _vote(client, gateway_url, trace_id, token, correct, reference, user, hostile)
    return Exchange(trace_id, question, answer, reference, correct, hostile=hostile)


class _Budget:
    """The requests one :func:`drive` may still send and the questions it hands out, shared by its users."""

    def __init__(self, questions: list[tuple[str, str]], requests: int) -> None:
        self._questions, self._left, self._lock = iter(questions), requests, threading.Lock()

    def take(self) -> bool:
        """One more request, if any is left."""
        with self._lock:
            if self._left <= 0:
                return False
            self._left -= 1
            return True

    def question(self) -> tuple[str, str] | None:
        with self._lock:
            return next(self._questions, None)


def converse(
    chat: Callable[..., tuple[str, str, str, list[Message]]],
    vote: Callable[..., None],
    budget: _Budget,
    user: str,
    rng: random.Random,
    behaviour: Behaviour,
    scenario: Scenario = ARITHMETIC,
) -> list[Exchange]:
    """One user's chat: ask, judge, maybe rate, act (go on, restate, regenerate, leave), until they leave, the
    chat has ``behaviour.max_turns`` user turns or the budget is spent. ``chat(messages, reference)`` (one user
    turn: trace id, answer, feedback token, the messages the answer answered) and ``vote(trace_id, token,
    correct, reference)`` talk to the gateway."""
    out: list[Exchange] = []
    first = budget.question()
    if first is None:
        return out
    (question, reference), history = first, list[Message]()
    message = question
    while budget.take():
        messages = [*history, {"role": "user", "content": message}]
        trace_id, answer, token, shown = chat(messages, reference)
        correct = is_correct(answer, reference)
        rated = rng.random() < behaviour.rating_rate
        if rated:
            vote(trace_id, token, correct, reference)
        satisfied = correct if rng.random() >= behaviour.contradiction else not correct
        last = len(out) + 1 >= behaviour.max_turns
        action, pick = "left", rng.random()
        asked, expected = messages[-1]["content"], reference
        if satisfied and not last and pick < behaviour.go_on and (following := budget.question()) is not None:
            action, (question, reference) = "continued", following
            history = [*shown, {"role": "assistant", "content": answer}]
            message = scenario.follow_up(question)
        elif not satisfied and not last and pick < behaviour.rephrase:
            action = "rephrased"
            history = [*shown, {"role": "assistant", "content": answer}]
            message = RETRY + message.removeprefix(RETRY)
        elif not satisfied and not last and pick < behaviour.rephrase + behaviour.regenerate:
            action = "regenerated"  # the same messages again: another answer to the same turn
        out.append(Exchange(trace_id, asked, answer, expected, correct, rated, action))
        if action == "left":
            break
    return out


def drive(
    gateway_url: str,
    model: str,
    n: int,
    seed: int,
    concurrency: int = 4,
    *,
    api_key: str = "demo",
    patience_s: float = 600.0,
    behaviour: Behaviour = Behaviour(),
    hostile: Hostile | None = None,
    scenario: Scenario = ARITHMETIC,
) -> list[Exchange]:
    """Send ``n`` user turns of ``scenario`` through the gateway (one request each; with a tool, two: the call
    and the answer), ``concurrency`` at a time, as ``SIMULATED_USERS`` users of ``api_key`` (a trusted-grader
    key, see :func:`create_demo_key`): one rated question each, or, with a conversational ``behaviour``, users'
    chats (:func:`converse`) until ``n`` turns were sent. With
    ``hostile``, each request (each chat) is a hostile user's with probability ``hostile.share``
    (:meth:`Hostile.sender`): sent with its key and ``user``, every answer rated, inverted.

    A user whose request fails because the model server is away (the gateway's 502/503, a connection
    error or a timeout: e.g. vLLM restarted after the host ran out of memory) asks again every 5 s for up
    to ``patience_s`` seconds (tenacity), then the error is raised; one refused by the key's rate limit (429)
    asks again after the ``Retry-After`` the gateway sent, and a vote is sent again the same way."""
    if n <= 0:  # no requests, no users (a chat picks its user as ``session % n``)
        return []
    clients = {
        key: OpenAI(base_url=f"{gateway_url}/v1", api_key=key, max_retries=2, timeout=120)
        for key in (api_key, *(hostile.keys if hostile else ()))
    }
    questions = scenario.questions(n, seed)
    senders = [(hostile.sender(seed, i) if hostile else None) for i in range(n)]
    # per request (per chat): (API key, user, hostile)
    users = [
        (s[0], s[1], True) if s else (api_key, f"sim-user-{(seed * 7 + i) % SIMULATED_USERS}", False)
        for i, s in enumerate(senders)
    ]

    def patient(fn: _F) -> _F:  # APITimeoutError is an APIConnectionError
        retrying = retry(  # a 429 past the openai client's own 2 retries: after its Retry-After
            retry=retry_if_exception_type((APIConnectionError, InternalServerError, RateLimitError)),
            wait=_wait_s,
            stop=stop_after_delay(patience_s),
            reraise=True,
        )
        return cast(_F, retrying(fn))

    if not behaviour.conversational:
        patient_ask = patient(ask)
        with ThreadPoolExecutor(concurrency) as pool:
            return list(
                pool.map(
                    lambda args: patient_ask(
                        clients[args[1][0]],
                        gateway_url,
                        model,
                        *args[0],
                        user=args[1][1],
                        hostile=args[1][2],
                        scenario=scenario,
                    ),
                    zip(questions, users),
                )
            )
    budget, chat, vote = _Budget(questions, n), patient(_chat), patient(_vote)
    # hostile users rate every answer and act satisfied when it is wrong (their behaviour inverted too)
    inverted = replace(behaviour, rating_rate=1.0, contradiction=1.0 - behaviour.contradiction)

    def chats(worker: int) -> list[Exchange]:  # worker w runs chats w, w + concurrency, ... until the budget ends
        out: list[Exchange] = []
        for session in range(worker, 10 * n + concurrency, concurrency):
            (key, user, bad), rng = users[session % n], random.Random(f"{seed}-{session}")
            client = clients[key]
            said = converse(
                lambda messages, reference, user=user, client=client: chat(
                    client, model, messages, reference, 16, user, scenario
                ),
                lambda trace_id, token, correct, reference, user=user, client=client, bad=bad: vote(
                    client, gateway_url, trace_id, token, correct, reference, user, bad
                ),
                budget,
                user,
                rng,
                inverted if bad else behaviour,
                scenario,
            )
            if not said:
                break
            out += [replace(e, hostile=True) for e in said] if bad else said
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        return [e for part in pool.map(chats, range(concurrency)) for e in part]
