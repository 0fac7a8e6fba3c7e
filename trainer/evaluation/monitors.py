"""Reward-hack monitors: a candidate's answers against the champion's, beyond the reward it was trained on.

A policy optimised against a learned or hand-written reward finds what the reward over-rates: answers
padded or cut to nothing, a format users relied on dropped, refusals or questions in place of answers,
broken tool calls (filtered from training, so never penalised). Each round measures them on the
candidates' and the champion's greedy held-out answers (:func:`trainer.evaluation.evaluate.evaluate`),
each canary on both sides' served traffic (:mod:`pipeline.canary.monitor`); the same rule judges both.

Per side, :func:`read_side` measures (:class:`SideReading`, in all and per user and per API key):

- ``mean_words``: mean answer length in words (whitespace-separated; what a user reads, the same for
  any tokenizer);
- ``format_share``: share of answers whose ``rl.monitors.format`` mix scores >= ``format_min_score``
  (rows without the mix's metadata left out);
- ``evasion_rate``: share of answers that refuse (:data:`REFUSAL`, in the first 200 characters) or,
  without a tool call, end with a question mark;
- ``invalid_tool_call_rate``: of the answers to rows that offered tools, the share holding a tool call
  that ``tool_call_valid`` rejects (:mod:`trainer.tool_calls`).

:data:`MONITORS` (keyed by :class:`Monitor`) turns two readings into a :class:`MonitorCheck` against
``[rl.monitors]``; :func:`check_all` runs them all and :func:`refusal` names the first that refuses.

No single user and no single API key can make a monitor refuse: served answers depend on what users ask,
so one user within its share (``rl.split.max_user_share``) asking the challenger for 300-word answers
could move its mean length past ``max_length_ratio``. A monitor whose drift crosses its limit is judged
again without each user's answers (both sides), then without each key's; when some unit's removal leaves
no refusal (a drift within the limit, or fewer than ``min_answers`` answers), that unit alone crosses it
and the check does not refuse (``MonitorCheck.alone``, and the reason says so). Users and keys are
:func:`trainer.data.metadata_user` / :func:`~trainer.data.metadata_key`: rows without a hash are one
user (or key) together. A kind with a single unit (e.g. every row without a user hash) is the whole
evidence and is not left out; with few keys (no key cap, :func:`trainer.data.key_share`) only keys holding
less than half of the answers are. The
per-answer measurements (:class:`~trainer.types.AnswerTally`) are taken once; a side without a unit is a
subtraction. The
canary's fifth monitor, ``reward_gap`` (the reward model's predicted gain vs the users' live
difference), lives with the canary, which has the live evidence (:mod:`pipeline.canary.monitor`);
:func:`predicted_rate` is its round half: the reward model's mean predicted thumbs-up probability.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Literal

from trainer.config import MonitorConfig
from trainer.data import key_share, metadata_key, metadata_user
from trainer.rewards import RewardMix, build_reward
from trainer.tool_calls import hermes_tool_calls, tool_call_valid
from trainer.types import AnswerTally, SideReading

REFUSAL = re.compile(
    r"\b(i\s+(?:can(?:no|'|’)t|cannot|am\s+(?:not\s+able|unable)|'m\s+(?:not\s+able|unable)|won(?:'|’)t\s+be\s+able)"
    r"|i(?:'|’)m\s+sorry|i\s+am\s+sorry|as\s+an\s+ai\b)",
    re.IGNORECASE,
)
"""A refusal: "I can't", "I cannot", "I'm unable", "I'm sorry", "As an AI", ... (English; a heuristic)."""
REFUSAL_SCAN_CHARS = 200


Unit = Literal["user", "key"]
"""Whose answers the leave-one-out rule takes out, one at a time: one user's, one API key's."""


class Monitor(StrEnum):
    """The reward-hack monitors (``monitor/<name>`` metrics, named in refusals)."""

    LENGTH = "length"
    FORMAT = "format"
    EVASION = "evasion"
    TOOL_CALLS = "tool_calls"
    REWARD_GAP = "reward_gap"  # canary only: pipeline.canary.monitor


@dataclass(frozen=True)
class Answer:
    """One answer to judge: the prompt's messages and metadata (with ``tools`` when the row offered some)
    and the answer's text (tool calls in the Hermes format: :func:`trainer.tool_calls.answer_text`)."""

    messages: Sequence[Mapping[str, Any]]
    text: str
    metadata: Mapping[str, Any]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def is_evasion(text: str) -> bool:
    """A refusal (:data:`REFUSAL` in the first :data:`REFUSAL_SCAN_CHARS` characters), or an answer
    without a tool call that ends with a question mark."""
    if REFUSAL.search(text[:REFUSAL_SCAN_CHARS]):
        return True
    return not hermes_tool_calls(text) and text.rstrip().endswith(("?", "？"))


def _tally(answer: Answer, mix: RewardMix, cfg: MonitorConfig) -> AnswerTally:
    """One answer's part of its side's readings (the format mix and the tool-call check run here, once)."""
    meta = dict(answer.metadata)
    scored = mix.accepts(meta)
    formatted = scored and mix(list(answer.messages), answer.text, meta) >= cfg.format_min_score  # type: ignore[arg-type]
    tools = bool(meta.get("tools"))
    return AnswerTally(
        answers=1,
        words=len(answer.text.split()),
        format_rows=int(scored),
        formatted=int(formatted),
        evasions=int(is_evasion(answer.text)),
        tool_rows=int(tools),
        invalid_tool_calls=int(
            tools and bool(hermes_tool_calls(answer.text)) and tool_call_valid(answer.messages, answer.text, meta) < 1.0
        ),
    )


def read_side(answers: Sequence[Answer], cfg: MonitorConfig) -> SideReading:
    """Measure one side's answers (see the module doc), in all and per user and per API key
    (:func:`trainer.data.metadata_user` / :func:`~trainer.data.metadata_key`: rows without a hash are one
    anonymous user, one unknown key), so :func:`check_all` can leave any one of them out."""
    mix = build_reward(cfg.format)
    total = AnswerTally()
    users: dict[str, AnswerTally] = {}
    keys: dict[str, AnswerTally] = {}
    for a in answers:
        one = _tally(a, mix, cfg)
        total += one
        user, key = metadata_user(dict(a.metadata)), metadata_key(dict(a.metadata))
        users[user] = users.get(user, AnswerTally()) + one
        keys[key] = keys.get(key, AnswerTally()) + one
    return SideReading(total, users, keys)


@dataclass(frozen=True)
class MonitorCheck:
    """One monitor's comparison: the candidate's and champion's values, the drift the threshold bounds
    (a ratio for ``length``, a difference otherwise), the limit (None: off), whether it refuses and why.
    ``alone``: ``user`` or ``key`` when the drift crosses the limit but not without one such unit's answers,
    so the monitor does not refuse (the reason says so); None otherwise."""

    monitor: Monitor
    candidate: float
    champion: float
    drift: float
    limit: float | None
    refuses: bool
    reason: str
    alone: Unit | None = None


def _skip(monitor: Monitor, candidate: float, champion: float, why: str) -> MonitorCheck:
    return MonitorCheck(monitor, candidate, champion, float("nan"), None, False, why)


def _enough(monitor: Monitor, n_cand: int, n_champ: int, cfg: MonitorConfig, what: str) -> str | None:
    if min(n_cand, n_champ) < cfg.min_answers:
        return f"{monitor}: too few {what} to judge ({n_cand} vs {n_champ}, min_answers {cfg.min_answers})"
    return None


def _length(cand: SideReading, champ: SideReading, cfg: MonitorConfig) -> MonitorCheck:
    m, high, low = Monitor.LENGTH, cfg.max_length_ratio, cfg.min_length_ratio
    few = _enough(m, cand.answers, champ.answers, cfg, "answers")
    if few:
        return _skip(m, cand.mean_words, champ.mean_words, few)
    # a side of empty answers: +1 word on both keeps the ratio finite and small differences of tiny answers mild
    ratio = (cand.mean_words + 1.0) / (champ.mean_words + 1.0)
    refuses = (high is not None and ratio > high) or (low is not None and ratio < low)
    allowed = f"{'0' if low is None else f'{low:g}'}..{'any' if high is None else f'{high:g}'}"
    reason = (
        f"monitor {m}: mean answer length {cand.mean_words:.1f} words vs champion {champ.mean_words:.1f} "
        f"(ratio {ratio:.2f}, allowed {allowed})"
    )
    return MonitorCheck(m, cand.mean_words, champ.mean_words, ratio, high, refuses, reason)


def _format(cand: SideReading, champ: SideReading, cfg: MonitorConfig) -> MonitorCheck:
    m, limit = Monitor.FORMAT, cfg.max_format_drop
    few = _enough(m, cand.format_rows, champ.format_rows, cfg, "answers the format mix can score")
    if few:
        return _skip(m, cand.format_share, champ.format_share, few)
    drop = champ.format_share - cand.format_share
    refuses = limit is not None and drop > limit
    reason = (
        f"monitor {m}: {cand.format_share:.0%} of answers match the format vs champion {champ.format_share:.0%} "
        f"(drop {drop:+.2f}, max_format_drop {limit})"
    )
    return MonitorCheck(m, cand.format_share, champ.format_share, drop, limit, refuses, reason)


def _evasion(cand: SideReading, champ: SideReading, cfg: MonitorConfig) -> MonitorCheck:
    m, limit = Monitor.EVASION, cfg.max_evasion_increase
    few = _enough(m, cand.answers, champ.answers, cfg, "answers")
    if few:
        return _skip(m, cand.evasion_rate, champ.evasion_rate, few)
    rise = cand.evasion_rate - champ.evasion_rate
    refuses = limit is not None and rise > limit
    reason = (
        f"monitor {m}: {cand.evasion_rate:.0%} of answers refuse or answer with a question vs champion "
        f"{champ.evasion_rate:.0%} (increase {rise:+.2f}, max_evasion_increase {limit})"
    )
    return MonitorCheck(m, cand.evasion_rate, champ.evasion_rate, rise, limit, refuses, reason)


def _tool_calls(cand: SideReading, champ: SideReading, cfg: MonitorConfig) -> MonitorCheck:
    m, limit = Monitor.TOOL_CALLS, cfg.max_tool_call_invalid_increase
    few = _enough(m, cand.tool_rows, champ.tool_rows, cfg, "answers to rows that offered tools")
    if few:
        return _skip(m, cand.invalid_tool_call_rate, champ.invalid_tool_call_rate, few)
    rise = cand.invalid_tool_call_rate - champ.invalid_tool_call_rate
    refuses = limit is not None and rise > limit
    reason = (
        f"monitor {m}: {cand.invalid_tool_call_rate:.0%} of answers to tool prompts hold an invalid tool call vs "
        f"champion {champ.invalid_tool_call_rate:.0%} (increase {rise:+.2f}, max_tool_call_invalid_increase {limit})"
    )
    return MonitorCheck(m, cand.invalid_tool_call_rate, champ.invalid_tool_call_rate, rise, limit, refuses, reason)


MONITORS: dict[Monitor, Callable[[SideReading, SideReading, MonitorConfig], MonitorCheck]] = {
    Monitor.LENGTH: _length,
    Monitor.FORMAT: _format,
    Monitor.EVASION: _evasion,
    Monitor.TOOL_CALLS: _tool_calls,
}
"""The answer monitors, in the order a refusal names them (``reward_gap`` is the canary's)."""


DRIFT = {Monitor.LENGTH: "ratio", Monitor.FORMAT: "drop", Monitor.EVASION: "increase", Monitor.TOOL_CALLS: "increase"}
"""What each answer monitor's drift is, as its reason names it."""


def _leave_one_out(
    check: MonitorCheck, cand: SideReading, champ: SideReading, cfg: MonitorConfig, max_key_share: float
) -> MonitorCheck:
    """``check`` (which refuses) judged again without each user's, then each API key's answers on both
    sides; when some unit's removal leaves no refusal (a smaller drift, or too few answers to judge), that
    unit alone crosses the limit and the check no longer refuses. A kind with a single unit is the whole
    evidence, not one voice in it, and is not left out (as :func:`trainer.data.user_cap` never cuts a
    single unit). Keys: every key once the key cap applies (:func:`trainer.data.key_share`: more than
    ``1 / max_key_share`` keys); with fewer (the operator's own keys, trusted as they are) only keys holding
    less than half of both sides' answers, so a key that makes up users cannot cause a refusal beside a busy
    app key, while the app key's own drift still refuses; none with the key cap off (``max_key_share`` 1)."""
    judge = MONITORS[check.monitor]
    none = AnswerTally()
    kinds: tuple[Unit, ...] = ("user", "key")
    for kind in kinds:
        cand_parts, champ_parts = (cand.users, champ.users) if kind == "user" else (cand.keys, champ.keys)
        units = sorted(set(cand_parts) | set(champ_parts))
        if kind == "key" and max_key_share >= 1.0:  # the key cap is off: keys are trusted as they are
            continue
        if kind == "key" and key_share(units, max_key_share) >= 1.0:  # few keys: those holding under half only
            total = cand.answers + champ.answers
            units = [
                u for u in units if 2 * (cand_parts.get(u, none).answers + champ_parts.get(u, none).answers) < total
            ]
        elif len(units) < 2:  # a single unit is the whole evidence
            continue
        passing = []
        for unit in units:
            c = judge(cand.without(cand_parts.get(unit, none)), champ.without(champ_parts.get(unit, none)), cfg)
            if not c.refuses:
                passing.append(c)
        if not passing:
            continue
        # the unit whose removal moves furthest toward no refusal: one that leaves too few answers, else the
        # largest move of the drift
        best = max(passing, key=lambda c: math.inf if math.isnan(c.drift) else abs(c.drift - check.drift))
        without = (
            "too few answers to judge without it"
            if math.isnan(best.drift)
            else f"{DRIFT[check.monitor]} {best.drift:.2f} without its answers"
        )
        reason = f"{check.reason}; one {kind} alone crosses it ({without}): not refused"
        return replace(check, refuses=False, reason=reason, alone=kind)
    return check


def check_all(
    cand: SideReading, champ: SideReading, cfg: MonitorConfig, *, max_key_share: float = 1.0
) -> list[MonitorCheck]:
    """Every answer monitor on the two readings (``cfg.enabled`` False: measured, none refuses). A monitor
    refuses only when it still refuses without the answers of any one user and of any one API key
    (:func:`_leave_one_out`; ``max_key_share``: ``rl.split.max_key_share``, 1.0 leaves no key out)."""
    checks = [check(cand, champ, cfg) for check in MONITORS.values()]
    if not cfg.enabled:
        return [replace(c, refuses=False) for c in checks]
    return [_leave_one_out(c, cand, champ, cfg, max_key_share) if c.refuses else c for c in checks]


def refusal(checks: Sequence[MonitorCheck]) -> str | None:
    """The reasons of every check that refuses, joined (None: none does)."""
    reasons = [c.reason for c in checks if c.refuses]
    return "; ".join(reasons) if reasons else None


def check_metrics(checks: Sequence[MonitorCheck], prefix: str = "monitor") -> dict[str, float]:
    """``<prefix>/<monitor>`` = the drift (finite drifts only), ``<prefix>/<monitor>/refused`` = 0/1, and
    ``<prefix>/<monitor>/<user|key>_alone`` = 1 when the drift crosses the limit only with one unit's answers."""
    out: dict[str, float] = {}
    for c in checks:
        if math.isfinite(c.drift):
            out[f"{prefix}/{c.monitor}"] = c.drift
        out[f"{prefix}/{c.monitor}/refused"] = float(c.refuses)
        if c.alone is not None:
            out[f"{prefix}/{c.monitor}/{c.alone}_alone"] = 1.0
    return out


def predicted_rate(scores: Sequence[float]) -> float:
    """The reward model's mean predicted probability of a thumbs-up, ``mean(sigmoid(score))`` (its scores are
    logits of an up-vote: :mod:`trainer.reward_model`); NaN without scores."""
    probs = [1.0 / (1.0 + math.exp(-max(min(s, 60.0), -60.0))) for s in scores if math.isfinite(s)]
    return _mean(probs)
