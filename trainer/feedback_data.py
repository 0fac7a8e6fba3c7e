"""Users' feedback in a snapshot table -> training examples for the reward model.

A snapshot row (columns: see :mod:`trainer.tasks`) whose ``reward`` (the
scalar the buffer joined from ``hourglass.feedback``) is set gives one
:class:`LabelledExample` with the binary label ``reward > 0`` (thumbs up).
Two rows with the same prompt messages and different labels give a
:class:`PreferencePair` (the up-voted completion is ``chosen``). A row whose
optional ``correction`` column (the user's corrected answer) is a non-empty
string different from the completion gives a pair ``correction ≻ completion``.
Tables without a ``correction`` column are read the same way, without those pairs.

Pure functions over Arrow tables; the round tokenises the texts.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from trainer.tasks import prompts_from_table

CORRECTION_COLUMN = "correction"


@dataclass(frozen=True)
class LabelledExample:
    """One served completion and the user's verdict on it.

    ``completion_token_ids`` are the logged token ids (None: tokenise ``completion``).
    """

    trace_id: str
    messages: list[dict[str, str]]
    completion: str
    completion_token_ids: tuple[int, ...] | None
    reward: float
    label: bool


@dataclass(frozen=True)
class PreferencePair:
    """``chosen`` ≻ ``rejected`` for the same prompt.

    ``source`` is ``"feedback"`` (two rated completions of one prompt) or
    ``"correction"`` (the user's correction over the served completion).
    Token ids None: tokenise the text.
    """

    messages: list[dict[str, str]]
    chosen: str
    chosen_token_ids: tuple[int, ...] | None
    rejected: str
    rejected_token_ids: tuple[int, ...] | None
    source: str


@dataclass(frozen=True)
class FeedbackData:
    """What one split of a snapshot teaches the reward model."""

    examples: tuple[LabelledExample, ...]
    pairs: tuple[PreferencePair, ...]

    @property
    def positives(self) -> int:
        return sum(e.label for e in self.examples)

    @property
    def negatives(self) -> int:
        return len(self.examples) - self.positives


def prompt_key(messages: Sequence[dict[str, str]]) -> str:
    """A canonical key of a chat prompt (same messages, same key)."""
    return json.dumps([dict(sorted(m.items())) for m in messages], ensure_ascii=False, separators=(",", ":"))


def labelled_examples(table: pa.Table) -> list[LabelledExample]:
    """Every row with a finite ``reward`` and a completion, in table order.

    Raises:
        DataError: a required column is missing, or a row's prompt/metadata is unreadable
            (from :func:`trainer.tasks.prompts_from_table`).
    """
    out = []
    for p in prompts_from_table(table):
        reward = p.logged_reward
        if reward is None or p.logged_completion is None or not math.isfinite(float(reward)):
            continue
        ids = tuple(p.logged_token_ids) if p.logged_token_ids else None
        out.append(
            LabelledExample(p.prompt_id, p.messages, p.logged_completion, ids, float(reward), float(reward) > 0.0)
        )
    return out


def feedback_pairs(examples: Sequence[LabelledExample]) -> list[PreferencePair]:
    """Same-prompt pairs with different labels.

    Per prompt with ``P`` up-voted and ``N`` down-voted completions, ``max(P, N)``
    pairs: the i-th pair is (up ``i mod P``, down ``i mod N``), so every rated
    completion is used and the count stays linear in the rows.
    """
    by_prompt: dict[str, tuple[list[LabelledExample], list[LabelledExample]]] = defaultdict(lambda: ([], []))
    for e in examples:
        by_prompt[prompt_key(e.messages)][0 if e.label else 1].append(e)
    pairs = []
    for ups, downs in by_prompt.values():
        if not ups or not downs:
            continue
        for i in range(max(len(ups), len(downs))):
            up, down = ups[i % len(ups)], downs[i % len(downs)]
            pairs.append(
                PreferencePair(
                    up.messages,
                    up.completion,
                    up.completion_token_ids,
                    down.completion,
                    down.completion_token_ids,
                    "feedback",
                )
            )
    return pairs


def correction_pairs(table: pa.Table) -> list[PreferencePair]:
    """``correction ≻ completion`` for every row with a correction (none when the column is absent)."""
    if CORRECTION_COLUMN not in table.column_names:
        return []
    corrections = table.column(CORRECTION_COLUMN).to_pylist()
    pairs = []
    for p, correction in zip(prompts_from_table(table), corrections):
        if not isinstance(correction, str) or not correction.strip() or p.logged_completion is None:
            continue
        if correction.strip() == p.logged_completion.strip():
            continue
        ids = tuple(p.logged_token_ids) if p.logged_token_ids else None
        pairs.append(PreferencePair(p.messages, correction, None, p.logged_completion, ids, "correction"))
    return pairs


def feedback_data(table: pa.Table) -> FeedbackData:
    """Labelled examples and preference pairs (feedback pairs, then correction pairs) of one split."""
    examples = labelled_examples(table)
    return FeedbackData(tuple(examples), tuple(feedback_pairs(examples) + correction_pairs(table)))
