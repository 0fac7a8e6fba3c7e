"""A round's data, prepared once: a buffer snapshot is split into train and held-out rows
(:func:`split_snapshot`, across users and time, each user's share capped), and
:func:`prepare_round_data` reads both tables once into what the round trains and evaluates on
(:class:`~trainer.types.RoundData`): prompts, the users' feedback as the reward model's labelled
examples and preference pairs, the data window and the per-user metrics.

Snapshot tables carry the buffer's columns: ``trace_id`` string, ``ts``
timestamp, ``model`` string, ``adapter_version`` string, ``prompt`` string
(JSON chat messages), ``completion`` string, ``completion_token_ids``
list<int32> (nullable), ``completion_logprobs`` list<float32> (nullable),
``reward`` float64 (nullable), ``metadata`` string (JSON object); and, when
the buffer has it, ``correction`` string (nullable: the user's corrected answer). Conversation columns
(``hourglass.trace/v2``; null on v1 rows, absent from older snapshots): ``tools`` string (JSON array of the
function tools the turn offered; also put in ``metadata["tools"]`` for the tool-call rewards),
``prompt_token_ids`` list<int32> (the prompt as vLLM served it: used as is, never rendered again) and
``completion_tool_calls`` string (JSON array of the answer's tool calls).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from trainer.errors import DataError
from trainer.types import FeedbackData, LabelledExample, PreferencePair, Prompt, RoundData, RoundInputs

SNAPSHOT_SCHEMA = pa.schema(
    [
        ("trace_id", pa.string()),
        ("ts", pa.timestamp("ms", tz="UTC")),
        ("model", pa.string()),
        ("adapter_version", pa.string()),
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("completion_logprobs", pa.list_(pa.float32())),
        ("reward", pa.float64()),
        ("metadata", pa.string()),
    ]
)
REQUIRED_COLUMNS = ("trace_id", "ts", "prompt", "metadata")


def snapshot_table(prompts: Sequence[Prompt], *, model: str = "hourglass", start: datetime | None = None) -> pa.Table:
    """A buffer-shaped table from prompts (one row each, 1 s apart, logged fields as given)."""
    start = start or datetime(2026, 1, 1, tzinfo=timezone.utc)
    rows = {
        "trace_id": [p.prompt_id for p in prompts],
        "ts": [start + timedelta(seconds=i) for i in range(len(prompts))],
        "model": [model] * len(prompts),
        "adapter_version": [p.logged_adapter_version for p in prompts],
        "prompt": [json.dumps(p.messages) for p in prompts],
        "completion": [p.logged_completion for p in prompts],
        "completion_token_ids": [p.logged_token_ids for p in prompts],
        "completion_logprobs": [p.logged_logprobs for p in prompts],
        "reward": [p.logged_reward for p in prompts],
        "metadata": [json.dumps(p.metadata) for p in prompts],
    }
    schema = SNAPSHOT_SCHEMA
    if any(p.logged_correction is not None for p in prompts):
        rows["correction"] = [p.logged_correction for p in prompts]
        schema = schema.append(pa.field("correction", pa.string()))
    if any(p.tools or p.logged_prompt_token_ids or p.logged_tool_calls for p in prompts):  # v2 conversation columns
        rows["tools"] = [json.dumps(p.tools) if p.tools else None for p in prompts]
        rows["prompt_token_ids"] = [p.logged_prompt_token_ids for p in prompts]
        rows["completion_tool_calls"] = [
            json.dumps(p.logged_tool_calls) if p.logged_tool_calls else None for p in prompts
        ]
        for name in ("tools", "prompt_token_ids", "completion_tool_calls"):
            schema = schema.append(pa.field(name, pa.list_(pa.int32()) if name == "prompt_token_ids" else pa.string()))
    return pa.Table.from_pydict(rows, schema=schema)


def _json_list(raw: Any, column: str, trace_id: str) -> list[dict[str, Any]] | None:
    """A JSON array-of-objects column (``tools``, ``completion_tool_calls``): None when null or empty."""
    if raw is None or raw == "":
        return None
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as err:
        raise DataError(f"row {trace_id!r}: {column} is not JSON: {err}") from err
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise DataError(f"row {trace_id!r}: {column} must be a JSON array of objects, got {str(raw)[:80]!r}")
    return value or None


def _text_content(content: Any) -> str:
    """A message's content as the text a chat template takes: OpenAI content parts -> their ``text``
    parts joined by newlines (other parts, e.g. images, dropped), null or missing -> "" (the buffer
    stores ``"content": null`` messages, e.g. an assistant turn with tool calls, without the key)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p["text"]
            for p in content
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return ""


def _messages(raw: str, trace_id: str) -> list[dict[str, str]]:
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        value = raw  # plain-text prompt
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        return [{**m, "content": _text_content(m.get("content"))} for m in value]
    raise DataError(
        f"row {trace_id!r}: prompt must be JSON chat messages [{{role, content}}] or text; got {raw[:80]!r}"
    )


def prompts_from_table(table: pa.Table) -> list[Prompt]:
    """Training prompts from a snapshot table (see the module docstring for columns).

    Raises:
        DataError: a required column is missing, or a row's prompt/metadata is unreadable.
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(f"snapshot table lacks columns {missing}; it has {table.column_names}")
    out = []
    for row in table.to_pylist():
        trace_id = str(row["trace_id"])
        try:
            metadata = json.loads(row["metadata"]) if row.get("metadata") else {}
        except ValueError as err:
            raise DataError(f"row {trace_id!r}: metadata is not JSON: {err}") from err
        if not isinstance(metadata, dict):
            raise DataError(f"row {trace_id!r}: metadata must be a JSON object, got {type(metadata).__name__}")
        tools = _json_list(row.get("tools"), "tools", trace_id)
        if tools:  # the tool-call rewards judge calls against the tools offered (the column wins over metadata)
            metadata = {**metadata, "tools": tools}
        out.append(
            Prompt(
                prompt_id=trace_id,
                messages=_messages(row["prompt"], trace_id),
                metadata=metadata,
                tools=tools,
                logged_prompt_token_ids=row.get("prompt_token_ids") or None,
                logged_tool_calls=_json_list(row.get("completion_tool_calls"), "completion_tool_calls", trace_id),
                logged_completion=row.get("completion"),
                logged_token_ids=row.get("completion_token_ids"),
                logged_logprobs=row.get("completion_logprobs"),
                logged_reward=row.get("reward"),
                logged_adapter_version=row.get("adapter_version"),
                logged_correction=row.get("correction"),  # absent in snapshots without the column
            )
        )
    return out


ANONYMOUS_USER = "anonymous"


def row_users(table: pa.Table) -> list[str]:
    """Each row's user: ``metadata.user_hash`` (the gateway sets it from the caller's API key and ``user``);
    rows without one (traces produced straight to Kafka) count as one user, ``"anonymous"``."""
    if "metadata" not in table.column_names:
        return [ANONYMOUS_USER] * table.num_rows
    users = []
    for raw in table.column("metadata").to_pylist():
        try:
            meta = json.loads(raw) if raw else {}
        except ValueError:
            meta = {}
        users.append(_user(meta))
    return users


def _user(metadata: object) -> str:
    user = metadata.get("user_hash") if isinstance(metadata, dict) else None
    return user if isinstance(user, str) and user else ANONYMOUS_USER


def _stable_rank(trace_id: str) -> str:
    """A per-row order nobody can choose (trace ids are issued by the gateway): SHA-256 of the trace id."""
    return hashlib.sha256(trace_id.encode("utf-8")).hexdigest()


def user_cap(counts: Sequence[int], max_share: float) -> int:
    """The most rows any one user may keep: the largest ``c`` with ``c <= s * sum(min(n, c))`` where
    ``s = max(max_share, 1 / users)`` (so a cap always exists, and an even split is never cut).

    Example: counts ``[100, 3, 3, 3, 3]``, share 0.2 -> 3 (the flood keeps 3 of 15 rows = 20 %).
    """
    if not counts:
        return 0
    share = max(max_share, 1.0 / len(counts))
    lo, hi = 1, max(counts)  # c = 1 always holds: 1 <= share * users
    while lo < hi:  # f(c) = share * T(c) - c is >= 0 on [0, c*]: binary search c*
        mid = (lo + hi + 1) // 2
        if mid <= share * sum(min(n, mid) for n in counts) + 1e-9:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cap_user_share(table: pa.Table, max_share: float) -> pa.Table:
    """``table`` with each user's rows cut to :func:`user_cap` (a user over the cap keeps the rows whose
    SHA-256 of trace id sorts first: spread over time, not chosen by the user). Row order is kept."""
    users = row_users(table)
    by_user: dict[str, list[int]] = {}
    for i, user in enumerate(users):
        by_user.setdefault(user, []).append(i)
    cap = user_cap([len(rows) for rows in by_user.values()], max_share)
    trace_ids = table.column("trace_id").to_pylist()
    keep: list[int] = []
    for rows in by_user.values():
        keep.extend(rows if len(rows) <= cap else sorted(rows, key=lambda i: _stable_rank(str(trace_ids[i])))[:cap])
    return table.take(sorted(keep)) if len(keep) < table.num_rows else table


def user_metrics(train: Sequence[Prompt], heldout: Sequence[Prompt], prefix: str = "data") -> dict[str, float]:
    """``{data/users, data/max_user_share, data/heldout_users, data/heldout_max_user_share}`` of a split's rows."""
    out: dict[str, float] = {}
    for name, part in (("", train), ("heldout_", heldout)):
        users = [_user(p.metadata) for p in part]
        counts = {u: users.count(u) for u in set(users)}
        out[f"{prefix}/{name}users"] = float(len(counts))
        out[f"{prefix}/{name}max_user_share"] = max(counts.values()) / len(users) if users else 0.0
    return out


def split_snapshot(
    table: pa.Table, heldout_fraction: float, *, max_user_share: float = 1.0
) -> tuple[pa.Table, pa.Table]:
    """``(train, heldout)``: the held-out set is drawn across users and time, then each part is capped per user.

    Rule: ``H = round(rows * heldout_fraction)`` held-out rows (at least 1, at most rows - 1) are shared among
    users in proportion to their rows (largest remainder; ties to the user with fewer rows); each user gives
    its newest rows. So every user's held-out rows are newer than their training rows, one user's burst
    before a round fills at most that user's proportional part, and with a single user (or no user hashes)
    the newest ``H`` rows are held out. Then :func:`cap_user_share` cuts each part so no user holds more than
    ``max_user_share`` of it (or an even split with few users); ``1.0`` = no cap.

    Raises:
        DataError: fraction outside (0, 1), share outside (0, 1], no ``ts`` column, or fewer than 2 rows.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction {heldout_fraction} must lie in (0, 1)")
    if not 0.0 < max_user_share <= 1.0:
        raise DataError(f"max_user_share {max_user_share} must lie in (0, 1]")
    if "ts" not in table.column_names:
        raise DataError(f"snapshot table has no 'ts' column to split by time; columns: {table.column_names}")
    if table.num_rows < 2:
        raise DataError(f"snapshot has {table.num_rows} rows; a train/held-out split needs at least 2")
    ordered = table.sort_by([("ts", "ascending"), ("trace_id", "ascending")])
    n_heldout = min(max(1, round(table.num_rows * heldout_fraction)), table.num_rows - 1)
    by_user: dict[str, list[int]] = {}
    for i, user in enumerate(row_users(ordered)):
        by_user.setdefault(user, []).append(i)
    quotas = {u: n_heldout * len(rows) / table.num_rows for u, rows in by_user.items()}
    share = {u: int(q) for u, q in quotas.items()}
    by_remainder = sorted(by_user, key=lambda u: (-(quotas[u] - share[u]), len(by_user[u]), u))
    for user in by_remainder[: n_heldout - sum(share.values())]:
        share[user] += 1
    held = sorted(i for u, rows in by_user.items() for i in rows[len(rows) - share[u] :])
    held_set = set(held)
    train = ordered.take([i for i in range(ordered.num_rows) if i not in held_set])
    heldout = ordered.take(held)
    if max_user_share < 1.0:
        train, heldout = cap_user_share(train, max_user_share), cap_user_share(heldout, max_user_share)
    return train, heldout


# --- users' feedback: the reward model's examples and pairs ----------------------------------
#
# A row whose ``reward`` (the scalar the buffer joined from ``hourglass.feedback``) is set gives one
# LabelledExample with the binary label ``reward > 0`` (thumbs up). Two rows with the same prompt
# messages and different labels give a PreferencePair (the up-voted completion is ``chosen``). A row
# whose ``correction`` (the user's corrected answer; the snapshot's optional column) is a non-empty
# string different from the completion gives a pair ``correction ≻ completion``. The round tokenises
# the texts.


def prompt_key(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """A canonical key of a chat prompt (same messages and tools offered, same key; without tools, the
    messages' key alone)."""
    key = json.dumps([dict(sorted(m.items())) for m in messages], ensure_ascii=False, separators=(",", ":"))
    return key + json.dumps(list(tools), sort_keys=True, separators=(",", ":")) if tools else key


def labelled_examples(rows: Sequence[Prompt]) -> list[LabelledExample]:
    """Every row with a finite logged reward and a logged completion, in row order."""
    out = []
    for p in rows:
        reward = p.logged_reward
        if reward is None or p.logged_completion is None or not math.isfinite(float(reward)):
            continue
        ids = tuple(p.logged_token_ids) if p.logged_token_ids else None
        prompt_ids = tuple(p.logged_prompt_token_ids) if p.logged_prompt_token_ids else None
        out.append(
            LabelledExample(
                p.prompt_id,
                p.messages,
                p.logged_completion,
                ids,
                float(reward),
                float(reward) > 0.0,
                p.tools,
                prompt_ids,
                p.logged_tool_calls,
            )
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
        by_prompt[prompt_key(e.messages, e.tools)][0 if e.label else 1].append(e)
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
                    up.tools,
                    up.prompt_token_ids,
                    up.tool_calls,
                    down.tool_calls,
                )
            )
    return pairs


def correction_pairs(rows: Sequence[Prompt]) -> list[PreferencePair]:
    """``correction ≻ completion`` for every row with a correction (none when the snapshot has no such column)."""
    pairs = []
    for p in rows:
        correction = p.logged_correction
        if not isinstance(correction, str) or not correction.strip() or p.logged_completion is None:
            continue
        if correction.strip() == p.logged_completion.strip():
            continue
        ids = tuple(p.logged_token_ids) if p.logged_token_ids else None
        prompt_ids = tuple(p.logged_prompt_token_ids) if p.logged_prompt_token_ids else None
        pairs.append(
            PreferencePair(
                p.messages,
                correction,
                None,
                p.logged_completion,
                ids,
                "correction",
                p.tools,
                prompt_ids,
                None,
                p.logged_tool_calls,
            )
        )
    return pairs


def feedback_data(rows: Sequence[Prompt]) -> FeedbackData:
    """Labelled examples and preference pairs (feedback pairs, then correction pairs) of one split."""
    examples = labelled_examples(rows)
    return FeedbackData(tuple(examples), tuple(feedback_pairs(examples) + correction_pairs(rows)))


# --- the data preparation step ------------------------------------------------------------------


def prepare_round_data(train: pa.Table, heldout: pa.Table) -> RoundData:
    """Read a round's train and held-out tables once: prompts, feedback, window, per-user metrics.

    Raises:
        DataError: a required column is missing, a row's prompt/metadata is unreadable, or the
            held-out table is empty.
    """
    train_rows, heldout_rows = prompts_from_table(train), prompts_from_table(heldout)
    if not heldout_rows:
        raise DataError("the held-out table is empty; widen the window or lower [rl.split] heldout_fraction")
    window_start, window_end = _window(train, heldout)
    return RoundData(
        train=tuple(train_rows),
        heldout=tuple(heldout_rows),
        train_feedback=feedback_data(train_rows),
        heldout_feedback=feedback_data(heldout_rows),
        window_start=window_start,
        window_end=window_end,
        metrics=user_metrics(train_rows, heldout_rows),
    )


def round_inputs(
    train: pa.Table,
    heldout: pa.Table,
    champions: Mapping[str, Path | None] | None = None,
    *,
    reward_champion: Path | None = None,
) -> RoundInputs:
    """A round's inputs from its train and held-out tables (:func:`prepare_round_data`) and the champions
    to beat (served model -> adapter folder; None or absent: the base)."""
    return RoundInputs(prepare_round_data(train, heldout), dict(champions or {}), reward_champion)


def _window(train: pa.Table, heldout: pa.Table) -> tuple[datetime, datetime]:
    """Oldest and newest ``ts`` over both tables (now, when neither has a ``ts``)."""
    chunks = [chunk for t in (train, heldout) if "ts" in t.column_names for chunk in t.column("ts").chunks]
    stamps = pa.chunked_array(chunks, type=chunks[0].type) if chunks else None
    if stamps is None or len(stamps) == 0:
        now = datetime.now(timezone.utc)
        return now, now
    return pc.min(stamps).as_py(), pc.max(stamps).as_py()
