"""Reward functions and the weighted reward mix of a candidate.

A reward function is any callable ``(prompt_messages, completion, metadata)
-> float``; ``metadata`` is the row's metadata object (``reference_answer``
lives there) plus, for logged rows, ``reward`` (the logged scalar).

Built-ins (name -> function): ``exact_answer``, ``first_number_answer``, ``short_answer``,
``json_valid``, ``length_penalty``, ``format``, ``logged``, ``reward_model`` (the round's
reward model's score of a fresh rollout, see :mod:`trainer.reward_model.model`). Anything else is imported from a
``module:function`` path. :func:`build_reward` turns a list of
:class:`~trainer.config.RewardTerm` into one callable.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from trainer.tool_calls import tool_call_exists, tool_call_json, tool_call_valid
from trainer.errors import RewardError

Messages = list[dict[str, str]]


class RewardTerm(Protocol):
    """One weighted term of a reward mix, as :class:`trainer.config.RewardTerm` holds it (the config imports
    this module to check built-in names, so the mix is typed by what it reads)."""

    @property
    def fn(self) -> str: ...

    @property
    def weight(self) -> float: ...

    @property
    def kwargs(self) -> Mapping[str, Any]: ...


class RewardFn(Protocol):
    """``(prompt_messages, completion, metadata) -> float`` (higher is better)."""

    def __call__(self, prompt_messages: Messages, completion: str, metadata: dict[str, Any], /) -> float: ...


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _as_number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def exact_answer(prompt_messages: Messages, completion: str, metadata: dict[str, Any], *, tol: float = 1e-6) -> float:
    """1.0 when the last number in the completion equals ``metadata["reference_answer"]``.

    Numbers compare numerically (``4.0`` == ``4``, within ``tol``); a
    non-numeric reference compares as a stripped string with the completion's
    last line. 0.0 otherwise.

    Raises:
        RewardError: the row has no ``reference_answer``.
    """
    if "reference_answer" not in metadata:
        raise RewardError(
            "exact_answer needs metadata['reference_answer'] on every row; "
            f"got keys {sorted(metadata)}: use another reward for rows without references"
        )
    reference = str(metadata["reference_answer"]).strip()
    ref_number = _as_number(reference)
    if ref_number is None:
        lines = completion.strip().splitlines()
        return float(bool(lines) and lines[-1].strip() == reference)
    found = _NUMBER.findall(completion)
    if not found:
        return 0.0
    value = _as_number(found[-1])
    return float(value is not None and math.isclose(value, ref_number, rel_tol=0.0, abs_tol=tol))


# Metadata keys a reward needs on a row; rounds leave rows without them out of that
# candidate's prompts instead of failing (traffic without references is normal).
exact_answer.required_metadata = ("reference_answer",)  # type: ignore[attr-defined]


_FIRST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number_answer(
    prompt_messages: Messages, completion: str, metadata: dict[str, Any], *, tol: float = 1e-6
) -> float:
    """1.0 when the first number in the completion (commas removed) equals the numeric
    ``metadata["reference_answer"]`` within ``tol``; 0.0 otherwise (also for a non-numeric reference).

    What a reader checks first ("13" in "13, because 9 + 4 = 13"); the demo's simulated
    users judge answers this way (:func:`pipeline.demo.traffic.is_correct`).

    Raises:
        RewardError: the row has no ``reference_answer``.
    """
    if "reference_answer" not in metadata:
        raise RewardError(
            f"first_number_answer needs metadata['reference_answer'] on every row; got keys {sorted(metadata)}"
        )
    match = _FIRST_NUMBER.search(completion.replace(",", ""))
    try:
        return float(match is not None and abs(float(match.group()) - float(str(metadata["reference_answer"]))) < tol)
    except ValueError:
        return 0.0


first_number_answer.required_metadata = ("reference_answer",)  # type: ignore[attr-defined]


_ANSWER_PREFIX = re.compile(r"^(?:final answer|the answer is|answer)\s*[:\-]?\s*", re.IGNORECASE)
_EDGE_PUNCT = "\"'`*_.,;:!?()[]{}"


def _words(text: str) -> list[str]:
    """Words casefolded, punctuation and markdown stripped at their edges (empty ones dropped)."""
    return [w for w in (word.strip(_EDGE_PUNCT).casefold() for word in text.split()) if w]


def short_answer(prompt_messages: Messages, completion: str, metadata: dict[str, Any]) -> float:
    """1.0 when the completion starts with ``metadata["reference_answer"]``: its first non-empty line,
    an ``Answer:`` / ``The answer is`` prefix removed, begins with the reference's words (compared
    casefolded, punctuation and markdown stripped at each word's edges; a numeric word numerically);
    0.0 otherwise. For prompts that ask for a short answer first (Yes/No, one word, a number, a short list):
    the shipped regression suite's check (``shipped:reasoning-gym-mix``).

    Raises:
        RewardError: the row has no ``reference_answer``.
    """
    if "reference_answer" not in metadata:
        raise RewardError(f"short_answer needs metadata['reference_answer'] on every row; got keys {sorted(metadata)}")
    reference = _words(str(metadata["reference_answer"]))
    lines = [line for line in completion.strip().splitlines() if line.strip()]
    if not reference or not lines:
        return 0.0
    answer = _words(_ANSWER_PREFIX.sub("", lines[0].strip().strip("*").strip()))[: len(reference)]
    if len(answer) != len(reference):
        return 0.0
    for got, want in zip(answer, reference):
        got_number, want_number = _as_number(got), _as_number(want)
        if want_number is not None and got_number is not None:
            if not math.isclose(got_number, want_number, rel_tol=0.0, abs_tol=1e-6):
                return 0.0
        elif got != want:
            return 0.0
    return 1.0


short_answer.required_metadata = ("reference_answer",)  # type: ignore[attr-defined]


def json_valid(prompt_messages: Messages, completion: str, metadata: dict[str, Any]) -> float:
    """1.0 when the completion (stripped, optional ```json fences removed) parses as JSON."""
    text = completion.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, flags=re.DOTALL)
    if fenced:
        text = fenced.group(1)
    try:
        json.loads(text)
    except (
        ValueError,
        RecursionError,
    ):  # nested past the parser's limit (a degenerate "[[[[..." answer): not JSON here
        return 0.0
    return 1.0


def length_penalty(
    prompt_messages: Messages,
    completion: str,
    metadata: dict[str, Any],
    *,
    target_chars: int = 0,
    per_char: float = 0.01,
) -> float:
    """``-per_char * max(0, len(completion) - target_chars)`` (characters; <= 0)."""
    return -per_char * max(0, len(completion) - target_chars)


def format_reward(prompt_messages: Messages, completion: str, metadata: dict[str, Any], *, max_words: int = 3) -> float:
    """Answer-only brevity: 1.0 for a non-empty completion of at most ``max_words``
    words that contains a number, 0.5 for a short one without a number, else 0.0."""
    words = completion.split()
    if not words or len(words) > max_words:
        return 0.0
    return 1.0 if _NUMBER.search(completion) else 0.5


def logged(prompt_messages: Messages, completion: str, metadata: dict[str, Any]) -> float:
    """The row's logged reward (``metadata["reward"]``); offline rows only.

    Raises:
        RewardError: no logged reward (a fresh rollout, or a row without feedback).
    """
    value = metadata.get("reward")
    if value is None:
        raise RewardError(
            "reward 'logged' needs the row's logged reward; fresh rollouts have none: "
            "use 'logged' only in offline_is candidates, and filter rows without rewards"
        )
    return float(value)


REWARD_MODEL_SCORE = "reward_model_score"  # metadata key the round fills with the reward model's score


def reward_model(
    prompt_messages: Messages, completion: str, metadata: dict[str, Any], *, probability: bool = True
) -> float:
    """The round's reward model on this completion: ``sigmoid(score)`` (the modelled
    probability of a thumbs-up, in [0, 1]) or, with ``probability=False``, the raw score.

    The round scores every fresh rollout of a ``grpo`` / ``ppo_clip`` candidate
    with the reward model in one batched pass per step and passes the score as
    ``metadata["reward_model_score"]``.

    Raises:
        RewardError: no score (an offline row, or a round without a reward model).
    """
    value = metadata.get(REWARD_MODEL_SCORE)
    if value is None:
        raise RewardError(
            "reward 'reward_model' needs the reward model's score of the completion; only grpo / ppo_clip "
            "candidates' rollouts are scored: use it there, with [reward_model] enabled and labelled feedback"
        )
    value = float(value)
    return 1.0 / (1.0 + math.exp(-value)) if probability else value


# Terms whose value exists only inside a training step (a logged reward, a reward-model score);
# held-out evaluation of new greedy answers drops them.
TRAINING_ONLY = frozenset({"logged", "reward_model"})

BUILTINS: dict[str, Callable[..., float]] = {
    "exact_answer": exact_answer,
    "first_number_answer": first_number_answer,
    "short_answer": short_answer,
    "json_valid": json_valid,
    "length_penalty": length_penalty,
    "format": format_reward,
    "logged": logged,
    "reward_model": reward_model,
    # tool calls in generated text (trainer/tool_calls.py): JSON, an offered tool, arguments valid by its schema
    "tool_call_json": tool_call_json,
    "tool_call_exists": tool_call_exists,
    "tool_call_valid": tool_call_valid,
}


def register(name: str, fn: Callable[..., float]) -> None:
    """Make ``fn`` available under ``name`` (plugins and tests).

    Raises:
        RewardError: ``name`` is already taken, or holds ':' (reserved for import paths).
    """
    if name in BUILTINS or ":" in name:
        raise RewardError(f"reward name {name!r} is taken or contains ':'; pick another")
    BUILTINS[name] = fn


def resolve(name: str) -> Callable[..., float]:
    """A built-in reward by name, or a function imported from ``module:function``.

    Raises:
        RewardError: unknown name, module not importable, or attribute missing.
    """
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" not in name:
        raise RewardError(f"unknown reward {name!r}: use one of {sorted(BUILTINS)} or a 'module:function' path")
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise RewardError(f"reward {name!r} cannot be imported: {err}") from err
    if not callable(fn):
        raise RewardError(f"reward {name!r} is not callable")
    return fn


def kwargs_problem(fn: Callable[..., float], kwargs: Mapping[str, Any]) -> str | None:
    """Why ``fn(messages, completion, metadata, **kwargs)`` cannot be called (an unknown or missing keyword, a
    function of other arity), in words; None when it can, or when ``fn`` has no signature to read."""
    try:
        inspect.signature(fn).bind([], "", {}, **kwargs)
    except TypeError as err:
        return str(err)
    except ValueError:  # no signature to read (a C builtin): found when it is called
        return None
    return None


class RewardMix:
    """The weighted sum ``sum_i w_i * f_i(prompt, completion, metadata)``.

    ``skip_logged=True`` drops the training-only terms ``logged`` and
    ``reward_model`` (used at evaluation, where completions are new and have
    no logged reward and no reward-model score).
    """

    def __init__(self, terms: Sequence[RewardTerm], *, skip_logged: bool = False) -> None:
        kept = [t for t in terms if not (skip_logged and t.fn in TRAINING_ONLY)]
        self.terms = tuple(kept)
        self._fns = [functools.partial(resolve(t.fn), **t.kwargs) for t in kept]

    def __bool__(self) -> bool:
        return bool(self.terms)

    @functools.cached_property
    def required_metadata(self) -> frozenset[str]:
        """Metadata keys every row must carry for this mix (union of the functions' ``required_metadata``)."""
        return frozenset(k for fn in self._fns for k in getattr(fn.func, "required_metadata", ()))

    def accepts(self, metadata: dict[str, Any]) -> bool:
        """Whether a row with this metadata can be scored by the mix."""
        return self.required_metadata.issubset(metadata)

    def __call__(self, prompt_messages: Messages, completion: str, metadata: dict[str, Any]) -> float:
        total = 0.0
        for term, fn in zip(self.terms, self._fns):
            value = float(fn(prompt_messages, completion, metadata))
            if math.isnan(value):
                raise RewardError(f"reward {term.fn!r} returned NaN for completion {completion[:60]!r}")
            total += term.weight * value
        return total


def build_reward(terms: Sequence[RewardTerm], *, skip_logged: bool = False) -> RewardMix:
    """A candidate's reward mix from its ``CandidateConfig.reward`` terms (see :class:`RewardMix`)."""
    return RewardMix(terms, skip_logged=skip_logged)
