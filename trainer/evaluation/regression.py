"""Regression suites against forgetting (``[[rl.regression]]``): read a suite's prompts, score a version's
greedy answers with its check, and the paired bound the gate refuses a forgetting candidate on.

A suite is a JSONL file of prompts and a check (:class:`~trainer.regression_config.RegressionSuiteConfig`).
Each round the evaluate phase answers every suite greedily for every candidate and its served model's
champion in the same engine call as the held-out rows (:mod:`trainer.evaluation.evaluate`) and scores the
answers with the suite's check; the gate (:mod:`trainer.evaluation.gate`) then refuses a candidate unless,
on every suite of its served model, the paired-bootstrap lower bound of mean(candidate - champion) score at
``rl.gate.confidence`` is at least ``-tolerance`` (:func:`suite_verdicts`): a non-inferiority test whose
burden of proof lies on the candidate, as the gate's own bound (Efron & Tibshirani 1993, percentile
interval; the same :func:`~trainer.evaluation.stats.paired_bootstrap_lower_bound`).

No model or engine here: reading files and numbers only.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import RLConfig
from trainer.errors import SuiteError
from trainer.evaluation.stats import paired_bootstrap_lower_bound
from trainer.regression_config import SHIPPED_PREFIX, RegressionSuiteConfig
from trainer.rewards import RewardError, RewardMix, build_reward, kwargs_problem, resolve
from trainer.types import Prompt, Sample, SuiteScores, SuiteVerdict

SHIPPED_DIR = Path(__file__).parent / "suites"
"""The suites Hourglass ships: ``shipped:<name>`` is ``SHIPPED_DIR / "<name>.jsonl"``."""

MAX_LINES = 4096  # lines read from a suite file at most (RegressionSuiteConfig.max_prompts <= this)
MAX_LINE_BYTES = 65_536  # longest line of a suite file
ROLES = frozenset({"system", "user", "assistant"})


class _CheckTerm:
    """A suite's check as one reward term (what :func:`trainer.rewards.build_reward` reads)."""

    def __init__(self, suite: RegressionSuiteConfig) -> None:
        self.fn, self.weight, self.kwargs = suite.check, 1.0, dict(suite.check_kwargs)


def suite_check(suite: RegressionSuiteConfig) -> RewardMix:
    """The suite's check as a reward mix of one term (a ``module:function`` is imported here).

    Raises:
        SuiteError: the check cannot be imported, is not callable, or cannot be called with its check_kwargs.
    """
    try:
        mix = build_reward([_CheckTerm(suite)])
        fn = resolve(suite.check)
    except RewardError as err:
        raise SuiteError(f"regression suite {suite.name!r}: check {suite.check!r}: {err}") from err
    problem = kwargs_problem(fn, suite.check_kwargs)  # refused when the suite loads, not after the engine call
    if problem is not None:
        raise SuiteError(
            f"regression suite {suite.name!r}: check {suite.check!r} cannot be called as "
            f"check(messages, answer, metadata, **check_kwargs) with check_kwargs {sorted(suite.check_kwargs)}: "
            f"{problem}"
        )
    return mix


def suite_file(suite: RegressionSuiteConfig, root: Path | None = None) -> Path:
    """The suite's file: a shipped one, or ``suite.path`` under ``root`` (default: the working directory).

    Raises:
        SuiteError: no such shipped suite, or the path (after symlinks) leads out of ``root``.
    """
    if suite.path.startswith(SHIPPED_PREFIX):
        name = suite.path.removeprefix(SHIPPED_PREFIX)
        file = SHIPPED_DIR / f"{name}.jsonl"
        if not file.is_file():
            shipped = sorted(SHIPPED_PREFIX + p.stem for p in SHIPPED_DIR.glob("*.jsonl"))
            raise SuiteError(f"regression suite {suite.name!r}: no shipped suite {name!r}; shipped: {shipped}")
        return file
    base = (root or Path(os.getcwd())).resolve()
    file = (base / suite.path).resolve()
    if not file.is_relative_to(base):
        raise SuiteError(
            f"regression suite {suite.name!r}: path {suite.path!r} resolves to {file}, outside the working "
            f"directory {base}; keep suite files (and what their symlinks point to) inside it"
        )
    return file


def load_suite(suite: RegressionSuiteConfig, root: Path | None = None) -> tuple[Prompt, ...]:
    """The first ``suite.max_prompts`` prompts of the suite's JSONL file, each checked.

    A line is an object with ``messages`` (a list of ``{role, content}``, roles system/user/assistant,
    content a string) or ``prompt`` (a string: one user message), an optional ``id`` (a string; default
    ``<suite>-<line>``) and an optional ``metadata`` object; blank lines are skipped. Every prompt must
    carry the metadata the suite's check needs (e.g. ``reference_answer`` for ``exact_answer``).

    Raises:
        SuiteError: the file is missing, outside ``root``, not UTF-8, a line is too long, not JSON or
            not such an object, a metadata key the check needs is missing, two ids repeat, or no prompt.
    """
    file = suite_file(suite, root)
    where = f"regression suite {suite.name!r} ({suite.path})"
    if not file.is_file():
        raise SuiteError(f"{where}: {file} does not exist or is not a file")
    needs = suite_check(suite).required_metadata
    prompts: list[Prompt] = []
    seen: set[str] = set()
    with file.open("rb") as lines:
        for number in range(1, MAX_LINES + 1):
            if len(prompts) >= suite.max_prompts:
                break
            raw = lines.readline(MAX_LINE_BYTES + 2)  # bounded: a line is never read past its limit
            if not raw:
                break
            if len(raw) > MAX_LINE_BYTES:
                raise SuiteError(f"{where} line {number}: longer than {MAX_LINE_BYTES} bytes")
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                raise SuiteError(f"{where} line {number}: not UTF-8 ({err.reason})") from err
            if not text:
                continue
            prompt = _prompt(text, f"{where} line {number}", f"{suite.name}-{number}")
            missing = sorted(needs - set(prompt.metadata))
            if missing:
                raise SuiteError(f"{where} line {number}: metadata lacks {missing}, which check {suite.check!r} needs")
            if prompt.prompt_id in seen:
                raise SuiteError(f"{where} line {number}: id {prompt.prompt_id!r} repeats an earlier line's")
            seen.add(prompt.prompt_id)
            prompts.append(prompt)
    if not prompts:
        raise SuiteError(f"{where}: no prompt in {file}")
    return tuple(prompts)


def _prompt(text: str, where: str, default_id: str) -> Prompt:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        raise SuiteError(f"{where}: not JSON ({err.msg})") from err
    except RecursionError:
        raise SuiteError(f"{where}: not JSON this parser reads (nested too deep)") from None
    if not isinstance(row, dict):
        raise SuiteError(f"{where}: a line must be a JSON object, got {type(row).__name__}")
    unknown = sorted(set(row) - {"id", "messages", "prompt", "metadata"})
    if unknown:
        raise SuiteError(f"{where}: unknown field(s) {unknown} (allowed: id, messages, prompt, metadata)")
    if ("messages" in row) == ("prompt" in row):
        raise SuiteError(f"{where}: give exactly one of 'messages' and 'prompt'")
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise SuiteError(f"{where}: 'prompt' must be a non-empty string")
        messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    else:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise SuiteError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        for i, message in enumerate(messages):
            if (
                not isinstance(message, dict)
                or set(message) != {"role", "content"}
                or message["role"] not in ROLES
                or not isinstance(message["content"], str)
            ):
                raise SuiteError(
                    f"{where}: messages[{i}] must be {{role, content}} with role one of {sorted(ROLES)} and "
                    "string content"
                )
    prompt_id = row.get("id", default_id)
    if not isinstance(prompt_id, str) or not prompt_id or len(prompt_id) > 200:
        raise SuiteError(f"{where}: 'id' must be a string of 1 to 200 characters")
    metadata = row.get("metadata", {})
    if not isinstance(metadata, dict):
        raise SuiteError(f"{where}: 'metadata' must be an object")
    return Prompt(prompt_id=prompt_id, messages=messages, metadata=metadata)


def score_suite(
    suite: RegressionSuiteConfig, prompts: Sequence[Prompt], answers: Sequence[Sample]
) -> tuple[float, ...]:
    """The check's score of each greedy answer (``answers[i]`` answers ``prompts[i]``).

    Raises:
        SuiteError: the check raised or returned NaN or an infinity on an answer (named by its prompt id).
    """
    check = suite_check(suite)
    out = []
    for prompt, answer in zip(prompts, answers, strict=True):
        try:
            value = float(check(prompt.messages, answer.text, prompt.metadata))
        except (RewardError, ValueError, TypeError, KeyError) as err:
            raise SuiteError(
                f"regression suite {suite.name!r}: check {suite.check!r} failed on prompt {prompt.prompt_id!r}: {err}"
            ) from err
        if not math.isfinite(value):
            raise SuiteError(
                f"regression suite {suite.name!r}: check {suite.check!r} returned {value} on prompt "
                f"{prompt.prompt_id!r}: not a finite number"
            )
        out.append(value)
    return tuple(out)


def suite_verdicts(
    candidate: str, scores: Mapping[str, SuiteScores], served_model: str, rl: RLConfig
) -> tuple[SuiteVerdict, ...]:
    """The candidate's verdict on every suite of ``served_model``, in config order: passed when the
    paired lower bound of mean(candidate - champion) score is at least ``-tolerance``. A suite that was
    not scored for the candidate, or whose bound is NaN, fails (nothing unmeasured is promoted)."""
    out = []
    for suite in rl.regression:
        if not suite.applies_to(served_model):
            continue
        measured = scores.get(suite.name)
        mine = measured.candidates.get(candidate) if measured is not None else None
        if measured is None or mine is None or len(mine) != len(measured.champion) or not mine:
            out.append(SuiteVerdict(suite.name, float("nan"), float("nan"), float("nan"), suite.tolerance, 0, False))
            continue
        diffs = [a - b for a, b in zip(mine, measured.champion)]
        bound = paired_bootstrap_lower_bound(diffs, rl.gate.confidence, rl.gate.bootstrap_samples, rl.seed)
        out.append(
            SuiteVerdict(
                suite=suite.name,
                champion_score=float(np.mean(measured.champion)),
                candidate_score=float(np.mean(mine)),
                lower_bound=bound,
                tolerance=suite.tolerance,
                prompts=len(mine),
                passed=math.isfinite(bound) and bound >= -suite.tolerance,
            )
        )
    return tuple(out)


def describe_failure(verdict: SuiteVerdict, champion_label: str) -> str:
    """Why a suite refused a candidate, in words (the gate's reason)."""
    if verdict.prompts == 0:
        return f"regression suite {verdict.suite!r} was not scored"
    return (
        f"forgets on regression suite {verdict.suite!r}: {verdict.candidate_score:.3f} vs {champion_label} "
        f"{verdict.champion_score:.3f} on {verdict.prompts} prompts, lower bound {verdict.lower_bound:+.3f} "
        f"< -tolerance {verdict.tolerance:g}"
    )
