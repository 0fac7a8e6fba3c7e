"""Reward-hack monitors of a running canary: the challenger's served answers against the champion's, and
the reward model's prediction against the users' live verdict.

:func:`canary_checks` runs, on the traces each side served since the canary started (the buffer's
snapshot; rated or not), the answer monitors of :mod:`trainer.evaluation.monitors` (length, format,
evasion, tool calls: the rule a round's gate applies to greedy held-out answers), plus the canary's own:

- ``reward_gap``: the round's reward model predicted the challenger's answers a thumbs-up rate
  ``predicted_gain`` above the champion's (``monitor/reward_model_gain``, logged on the version's run by
  the round: :func:`trainer.evaluation.monitors.predicted_rate` of both sides' greedy held-out answers);
  when that exceeds the upper end of the canary's always-valid interval of the users' live difference by
  more than ``rl.monitors.max_reward_gap``, the reward model loves what users do not (thumbs feedback
  only: the gain is a rate). The round logs a prediction only for a candidate that could have gamed the
  reward model (:func:`trainer.evaluation.evaluate.could_hack_reward_model`); for the others this monitor
  never judges.

A monitor that refuses aborts the canary (:mod:`pipeline.canary.monitor`) with the monitor named.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.canary.sequential import Verdict
from trainer.config import MonitorConfig
from trainer.data import capped_rows, key_share, metadata_key, metadata_user, prompts_from_table
from trainer.errors import DataError
from trainer.evaluation.monitors import Answer, Monitor, MonitorCheck, check_all, read_side
from trainer.tool_calls import answer_text
from trainer.types import Prompt

GAIN_METRIC = "monitor/reward_model_gain"


def _prompts(table: pa.Table) -> list[Prompt]:
    """Rows as prompts; a row that cannot be read (it passed ingest, so rarely) is left out, not fatal."""
    try:
        return prompts_from_table(table)
    except DataError:
        out: list[Prompt] = []
        for i in range(table.num_rows):
            try:
                out += prompts_from_table(table.slice(i, 1))
            except DataError:
                continue
        return out


def served_answers(
    table: pa.Table, model: str, *, max_user_share: float = 1.0, max_key_share: float = 1.0
) -> dict[str | None, list[Answer]]:
    """``{adapter_version: [Answer, ...]}`` of the public ``model``'s traces in ``table`` with a completion
    (text and tool calls, :func:`trainer.tool_calls.answer_text`), each side capped per API key and per user
    as the feedback evidence is (:func:`pipeline.canary.monitor.capped_side`; whether keys are capped is decided
    by the keys of every side): one user asking for many refusals cannot abort a canary alone."""
    if table.num_rows == 0 or "model" not in table.column_names:
        return {}
    table = table.filter(pc.equal(table["model"], model))
    sides: dict[str | None, list[Prompt]] = {}
    for p in _prompts(table):
        if p.logged_completion is not None or p.logged_tool_calls:
            sides.setdefault(p.logged_adapter_version, []).append(p)
    out: dict[str | None, list[Answer]] = {}
    share = key_share([metadata_key(p.metadata) for rows in sides.values() for p in rows], max_key_share)
    for version, rows in sides.items():
        keys = [metadata_key(p.metadata) for p in rows]
        caps = [(keys, share), ([metadata_user(p.metadata) for p in rows], max_user_share)]
        out[version] = [
            Answer(
                rows[i].messages,
                answer_text(rows[i].logged_completion or "", rows[i].logged_tool_calls),
                rows[i].metadata,
            )
            for i in capped_rows([p.prompt_id for p in rows], caps)
        ]
    return out


def reward_gap_check(
    predicted_gain: float | None, verdict: Verdict, binary: bool, cfg: MonitorConfig
) -> MonitorCheck | None:
    """The ``reward_gap`` monitor (module doc); None when it cannot judge yet (no prediction, no interval,
    feedback that is not thumbs)."""
    if predicted_gain is None or not math.isfinite(predicted_gain) or verdict.upper is None or not binary:
        return None
    gap = predicted_gain - verdict.upper
    limit = cfg.max_reward_gap
    refuses = cfg.enabled and limit is not None and gap > limit
    reason = (
        f"monitor {Monitor.REWARD_GAP}: the reward model predicted {predicted_gain:+.3f} thumbs-up rate over the "
        f"champion, users' live difference is at most {verdict.upper:+.3f} (gap {gap:+.3f}, max_reward_gap {limit})"
    )
    return MonitorCheck(Monitor.REWARD_GAP, predicted_gain, verdict.upper, gap, limit, refuses, reason)


def canary_checks(
    answers: dict[str | None, list[Answer]],
    challenger: str,
    control: str | None,
    verdict: Verdict,
    binary: bool,
    predicted_gain: float | None,
    cfg: MonitorConfig,
    *,
    max_key_share: float = 1.0,
) -> list[MonitorCheck]:
    """Every monitor of the canary of version ``challenger`` against ``control`` (the champion's version,
    None for the base). An answer monitor refuses only when it still refuses without the answers of any one
    user and of any one API key (``max_key_share``: ``rl.split.max_key_share``;
    :func:`trainer.evaluation.monitors.check_all`)."""
    cand, champ = read_side(answers.get(challenger, []), cfg), read_side(answers.get(control, []), cfg)
    checks = check_all(cand, champ, cfg, max_key_share=max_key_share)
    gap = reward_gap_check(predicted_gain, verdict, binary, cfg)
    return checks + ([gap] if gap is not None else [])


def as_view(checks: Sequence[MonitorCheck]) -> dict[str, dict[str, Any]]:
    """The checks for the canary's view (``/status``, the version's ``hourglass.canary_result`` tag, which is
    cut at 4900 characters): per monitor its values, and its reason only when it refuses (the decision's
    reason repeats it), cannot judge yet, or crosses its limit only with one user's or key's answers
    (``alone``: not refused)."""
    out = {}
    for c in checks:
        row = asdict(c)
        row.pop("monitor")
        if not c.refuses and math.isfinite(c.drift) and c.alone is None:
            row.pop("reason")
        out[str(c.monitor)] = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()
        }
    return out
