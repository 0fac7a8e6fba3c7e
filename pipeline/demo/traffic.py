"""Simulated users: verifiable questions sent through the gateway with the
official ``openai`` client, answers checked as a user would, feedback posted.

Prompts come from reasoning-gym (procedural arithmetic). The user's feedback
is a thumbs up when the answer is right and a thumbs down otherwise, sent with
the API key and the response's feedback token; half of the users (the even
ones, :data:`EDITING_USERS`) also edit a wrong answer into the right number,
sent as the feedback's ``correction``: thumbs and edits are all the demo's
candidates learn from. Each request also carries the reference answer in
``metadata``, for the demo's own scoreboard and its oracle recipe
(``first_number_answer``, the users' own check as a reward); the gateway keeps
it as a label only from a trusted-grader key (:func:`create_demo_key` makes
one). Each simulated user sends its own ``user`` id, so per-user caps see
several users.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import APIConnectionError, InternalServerError, OpenAI
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_fixed

from connectors.gateway.auth import KeyStore
from trainer.rewards import first_number_answer
from trainer.tasks import reasoning_gym_prompts

FEEDBACK_HEADER = "x-hourglass-feedback-token"
SIMULATED_USERS = 16
EDITING_USERS = frozenset(f"sim-user-{i}" for i in range(0, SIMULATED_USERS, 2))  # they correct wrong answers


@dataclass(frozen=True)
class Exchange:
    """One request through the gateway and what the user made of it."""

    trace_id: str
    question: str
    answer: str
    reference: str
    correct: bool


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


def create_demo_key(state_dir: str | Path, name: str = "demo") -> str:
    """A new trusted-grader API key in the gateway's key store under ``state_dir`` (the demo's simulated
    users send reference answers, which only a trusted grader may set); returns the key string."""
    _, key = KeyStore(Path(state_dir) / "gateway-keys.json").create(name, trusted_grader=True)
    return key


def ask(
    client: OpenAI,
    gateway_url: str,
    model: str,
    question: str,
    reference: str,
    max_tokens: int = 16,
    *,
    user: str | None = None,
) -> Exchange:
    """One chat completion through the gateway, then the user's feedback (same API key, the response's token):
    thumbs by the users' check, and from one of :data:`EDITING_USERS` a wrong answer's correction."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0.7,
        extra_body={
            "metadata": {"reference_answer": reference, "task": "basic_arithmetic"},
            **({"user": user} if user else {}),
        },
    )
    trace_id = raw.headers.get("x-hourglass-trace-id", "")
    answer = raw.parse().choices[0].message.content or ""
    correct = is_correct(answer, reference)
    vote = {
        "trace_id": trace_id,
        "thumbs": "up" if correct else "down",
        "feedback_token": raw.headers.get(FEEDBACK_HEADER, ""),
    }
    if not correct and user in EDITING_USERS:
        vote["correction"] = reference  # the user's edit: the answer they wanted
    headers = {"authorization": f"Bearer {client.api_key}"}
    httpx.post(f"{gateway_url}/v1/feedback", json=vote, headers=headers, timeout=30).raise_for_status()
    return Exchange(trace_id, question, answer, reference, correct)


def drive(
    gateway_url: str,
    model: str,
    n: int,
    seed: int,
    concurrency: int = 4,
    *,
    api_key: str = "demo",
    patience_s: float = 600.0,
) -> list[Exchange]:
    """Send ``n`` questions through the gateway, ``concurrency`` at a time, as ``SIMULATED_USERS`` users of
    ``api_key`` (a trusted-grader key, see :func:`create_demo_key`).

    A user whose request fails because the model server is away (the gateway's 502/503, a connection
    error or a timeout: e.g. vLLM restarted after the host ran out of memory) asks again every 5 s for up
    to ``patience_s`` seconds (tenacity), then the error is raised."""
    client = OpenAI(base_url=f"{gateway_url}/v1", api_key=api_key, max_retries=2, timeout=120)
    questions = arithmetic_questions(n, seed)
    users = [f"sim-user-{(seed * 7 + i) % SIMULATED_USERS}" for i in range(n)]
    patient = retry(
        retry=retry_if_exception_type((APIConnectionError, InternalServerError)),
        wait=wait_fixed(5),
        stop=stop_after_delay(patience_s),
        reraise=True,
    )(ask)  # APITimeoutError is an APIConnectionError
    with ThreadPoolExecutor(concurrency) as pool:
        return list(
            pool.map(lambda args: patient(client, gateway_url, model, *args[0], user=args[1]), zip(questions, users))
        )
