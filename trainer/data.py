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
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc

from connectors.schema import content_text
from trainer.errors import DataError, NotEnoughDataError
from trainer.types import (
    CORRECTION_SOURCE,
    FeedbackData,
    LabelledExample,
    PreferencePair,
    Prompt,
    RoundData,
    RoundInputs,
    correction_text,
    implicit_label,
)

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
    if any(p.logged_reward_source is not None for p in prompts):
        rows["reward_source"] = [p.logged_reward_source for p in prompts]
        schema = schema.append(pa.field("reward_source", pa.string()))
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


def _messages(raw: str, trace_id: str) -> list[dict[str, str]]:
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        value = raw  # plain-text prompt
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        return [{**m, "content": content_text(m.get("content"))} for m in value]
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
                logged_reward_source=row.get("reward_source"),
            )
        )
    return out


ANONYMOUS_USER = "anonymous"
UNKNOWN_KEY = "unknown-key"
"""The API key unit of rows without ``metadata.key_hash``: traces from other trusted producers (native
clients on Kafka, OTel) and gateway traces written before the gateway recorded the key. They count as one
key (one producer), so the key cap bounds them together like any one client."""


def _metadata_rows(table: pa.Table) -> list[dict[str, Any]]:
    if "metadata" not in table.column_names:
        return [{} for _ in range(table.num_rows)]
    out = []
    for raw in table.column("metadata").to_pylist():
        try:
            meta = json.loads(raw) if raw else {}
        except ValueError:
            meta = {}
        out.append(meta if isinstance(meta, dict) else {})
    return out


def row_users(table: pa.Table) -> list[str]:
    """Each row's user: ``metadata.user_hash`` (the gateway sets it from the caller's API key and ``user``);
    rows without one (traces produced straight to Kafka) count as one user, ``"anonymous"``."""
    return [_user(meta) for meta in _metadata_rows(table)]


def row_keys(table: pa.Table) -> list[str]:
    """Each row's API key: ``metadata.key_hash`` (the gateway's keyed hash of the caller's key id);
    rows without one count as one key, :data:`UNKNOWN_KEY`."""
    return [_key(meta) for meta in _metadata_rows(table)]


def _user(metadata: object) -> str:
    user = metadata.get("user_hash") if isinstance(metadata, dict) else None
    return user if isinstance(user, str) and user else ANONYMOUS_USER


def _key(metadata: object) -> str:
    key = metadata.get("key_hash") if isinstance(metadata, dict) else None
    return key if isinstance(key, str) and key else UNKNOWN_KEY


def metadata_user(metadata: object) -> str:
    """The user of a row's parsed metadata (``user_hash``, else :data:`ANONYMOUS_USER`), as :func:`row_users`."""
    return _user(metadata)


def metadata_key(metadata: object) -> str:
    """The API key of a row's parsed metadata (``key_hash``, else :data:`UNKNOWN_KEY`), as :func:`row_keys`."""
    return _key(metadata)


def _stable_rank(trace_id: str) -> str:
    """A per-row order nobody can choose (trace ids are issued by the gateway): SHA-256 of the trace id."""
    return hashlib.sha256(trace_id.encode("utf-8")).hexdigest()


def user_cap(counts: Sequence[int], max_share: float) -> int:
    """The most rows any one user (or key) may keep: the largest ``c`` with ``c <= s * sum(min(n, c))`` where
    ``s = max(max_share, 1 / users)`` (so a cap always exists, and an even split is never cut), and never below
    the (lower) median user's count: a user outweighs its share when it holds more than the typical user, not
    when most users are busy and a few sent one trace.

    Examples, share 0.2: counts ``[100, 3, 3, 3, 3]`` -> 3 (the flood keeps 3 of 15 rows = 20 %); ``[40, 40, 40,
    40, 1]`` -> 40 (four busy apps and one new user: nobody is cut; the share bound alone would cut every app to
    1 row, since four equal users cannot each hold 20 %). A single unit is never cut (``s = 1``): a deployment
    with one API key is not capped per key.
    """
    if not counts:
        return 0
    share = max(max_share, 1.0 / len(counts))
    lo, hi = max(1, int(statistics.median_low(counts))), max(counts)  # c = the floor always holds: see above
    while lo < hi:  # f(c) = share * T(c) - c is >= 0 on [0, c*]: binary search c*
        mid = (lo + hi + 1) // 2
        if mid <= share * sum(min(n, mid) for n in counts) + 1e-9:
            lo = mid
        else:
            hi = mid - 1
    return lo


def key_share(keys: Sequence[str], max_key_share: float) -> float:
    """The share the key cap applies to rows of these ``keys``: ``max_key_share`` when there are more keys
    than ``1 / max_key_share``, else 1.0 (no key cap). With so few keys every cap would be an even split, and a
    deployment of one busy app key beside a test key (or beside OpenTelemetry or Kafka producers, one key
    together) would lose nearly all of its rows; API keys are issued by the operator, so a few of them are
    trusted as they are, while a key that makes up users is bounded once there are enough keys to share the
    rows (issue 28: 6 keys at the default 0.2). Users keep the even-split floor (:func:`user_cap`)."""
    return max_key_share if len(set(keys)) * max_key_share > 1.0 + 1e-9 else 1.0


def capped_rows(
    trace_ids: Sequence[str], caps: Sequence[tuple[Any, ...]], keep: Sequence[int] | None = None
) -> list[int]:
    """The indices (ascending) of the rows kept when each unit of every ``(unit of each row, max share)`` in
    ``caps`` (e.g. users, API keys) is cut to :func:`user_cap` of its share. A unit over its cap keeps the rows
    whose SHA-256 of trace id sorts first (spread over time, not chosen by the client). Cutting one kind of unit
    can raise another's share, so the cuts repeat until a pass cuts nothing: then every cap holds at once.
    ``keep``: the rows to start from (default all). A cap may name a third element, the units known
    beyond these rows (a split's part: the snapshot's keys): the even-split floor counts them too, so a
    part that holds one key alone is still capped."""
    kept = list(range(len(trace_ids))) if keep is None else sorted(keep)
    while True:
        before = len(kept)
        for units, max_share, *known in caps:
            if max_share >= 1.0:
                continue
            by_unit: dict[str, list[int]] = {}
            for i in kept:
                by_unit.setdefault(units[i], []).append(i)
            absent = set(known[0]) - set(by_unit) if known else set()  # units elsewhere: they count for the floor
            cap = user_cap([len(rows) for rows in by_unit.values()] + [0] * len(absent), max_share)
            kept = sorted(
                i
                for rows in by_unit.values()
                for i in (rows if len(rows) <= cap else sorted(rows, key=lambda i: _stable_rank(trace_ids[i]))[:cap])
            )
        if len(kept) == before:
            return kept


def capped_prompts(
    rows: Sequence[Prompt], max_user_share: float, max_key_share: float, keep: Sequence[int] | None = None
) -> list[int]:
    """The indices (ascending) of ``rows`` kept when each API key and user is cut to its share
    (:func:`capped_rows`, the key cap by :func:`key_share` of these rows' keys); ``keep``: the rows to start from."""
    keys = [_key(p.metadata) for p in rows]
    caps = [(keys, key_share(keys, max_key_share)), ([_user(p.metadata) for p in rows], max_user_share)]
    return capped_rows([p.prompt_id for p in rows], caps, keep)


def cap_user_share(table: pa.Table, max_share: float) -> pa.Table:
    """``table`` with each user's rows cut to :func:`user_cap` (a user over the cap keeps the rows whose
    SHA-256 of trace id sorts first: spread over time, not chosen by the user). Row order is kept."""
    return cap_shares(table, max_user_share=max_share)


def cap_shares(
    table: pa.Table,
    *,
    max_user_share: float = 1.0,
    max_key_share: float = 1.0,
    keys_deciding: Sequence[str] | None = None,
) -> pa.Table:
    """``table`` with each API key's and each user's rows cut so that none holds more than its share
    (:func:`capped_rows`; an even split, or a single key or user, is never cut). Row order is kept.
    ``keys_deciding``: the keys whose number decides whether the key cap applies (:func:`key_share`;
    default this table's): a split passes the whole snapshot's, so a part that happens to hold few keys
    is capped like the others."""
    trace_ids = [str(t) for t in table.column("trace_id").to_pylist()]
    keys = row_keys(table)
    known = keys if keys_deciding is None else keys_deciding
    keep = capped_rows(
        trace_ids, [(keys, key_share(known, max_key_share), set(known)), (row_users(table), max_user_share)]
    )
    return table.take(keep) if len(keep) < table.num_rows else table


def _shares(units: Sequence[str]) -> tuple[float, float]:
    """(number of units, the largest unit's share of the rows)."""
    counts = Counter(units)
    return float(len(counts)), (max(counts.values()) / len(units) if units else 0.0)


def user_metrics(train: Sequence[Prompt], heldout: Sequence[Prompt], prefix: str = "data") -> dict[str, float]:
    """``{data/users, data/max_user_share, data/keys, data/max_key_share}`` of the train rows and the same with
    ``heldout_`` of the held-out rows (after the caps: what the round trains and evaluates on)."""
    out: dict[str, float] = {}
    for name, part in (("", train), ("heldout_", heldout)):
        for unit, of in (("user", _user), ("key", _key)):
            count, top = _shares([of(p.metadata) for p in part])
            out[f"{prefix}/{name}{unit}s"] = count
            out[f"{prefix}/{name}max_{unit}_share"] = top
    return out


def split_snapshot(
    table: pa.Table, heldout_fraction: float, *, max_user_share: float = 1.0, max_key_share: float = 1.0
) -> tuple[pa.Table, pa.Table]:
    """``(train, heldout)``: the held-out set is drawn across users and time, then each part is capped per user.

    Rule: ``H = round(rows * heldout_fraction)`` held-out rows (at least 1, at most rows - 1) are shared among
    users in proportion to their rows (largest remainder; ties to the user with fewer rows); each user gives
    its newest rows. So every user's held-out rows are newer than their training rows, one user's burst
    before a round fills at most that user's proportional part, and with a single user (or no user hashes)
    the newest ``H`` rows are held out. Then :func:`cap_shares` cuts each part so no API key
    (``metadata.key_hash``) holds more than ``max_key_share`` of it and no user more than ``max_user_share``
    (or an even split with few keys or users; a single key is never cut); ``1.0`` = no cap. The key cap is
    what bounds a client that sends a different ``user`` on every request: its made-up users are many, its
    key is one.

    Raises:
        DataError: fraction outside (0, 1), a share outside (0, 1] or no ``ts`` column.
        NotEnoughDataError: fewer than 2 rows.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction {heldout_fraction} must lie in (0, 1)")
    for name, value in (("max_user_share", max_user_share), ("max_key_share", max_key_share)):
        if not 0.0 < value <= 1.0:
            raise DataError(f"{name} {value} must lie in (0, 1]")
    if "ts" not in table.column_names:
        raise DataError(f"snapshot table has no 'ts' column to split by time; columns: {table.column_names}")
    if table.num_rows < 2:
        raise NotEnoughDataError(f"snapshot has {table.num_rows} rows; a train/held-out split needs at least 2")
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
    if max_user_share < 1.0 or max_key_share < 1.0:
        every_key = row_keys(ordered)  # whether the key cap applies is decided on the whole snapshot
        train, heldout = (
            cap_shares(part, max_user_share=max_user_share, max_key_share=max_key_share, keys_deciding=every_key)
            for part in (train, heldout)
        )
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
                p.logged_reward_source or "",
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
        correction = correction_text(p)
        if correction is None or p.logged_completion is None:
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


def correction_row(p: Prompt) -> Prompt | None:
    """The user's correction of ``p``'s answer (:func:`correction_text`) as a held-out row of its own: the same
    conversation, the correction as its logged answer (text only: no served ids), reward +1 from source
    :data:`CORRECTION_SOURCE`; None when there is none."""
    correction = correction_text(p)
    if correction is None:
        return None
    return replace(
        p,
        prompt_id=f"{p.prompt_id}/correction",
        logged_completion=correction,
        logged_token_ids=None,
        logged_logprobs=None,
        logged_reward=1.0,
        logged_adapter_version=None,
        logged_correction=None,
        logged_tool_calls=None,
        logged_reward_source=CORRECTION_SOURCE,
    )


def explicit_rows(rows: Sequence[Prompt]) -> list[Prompt]:
    """``rows`` with their positives taken from what users said (``positives_from = "explicit"``): a logged
    answer only implicit signals called good (``continued``: users also go on after wrong answers they did not
    notice) loses its label, or becomes a negative when the user corrected it (the correction says it was not
    the answer wanted); each correction (:func:`correction_row`) is a positive row of its own, right after its
    row. Explicit labels and negative implicit ones are kept as they are; order is kept."""
    out: list[Prompt] = []
    for p in rows:
        correction = correction_row(p)
        reward = p.logged_reward
        if reward is not None and implicit_label(p) and reward > 0:
            p = replace(p, logged_reward=-reward if correction is not None else None)
        out.append(p)
        if correction is not None:
            out.append(correction)
    return out


def _rated(p: Prompt) -> bool:
    """A row that is a labelled example: a logged answer with a finite reward."""
    reward = p.logged_reward
    return reward is not None and p.logged_completion is not None and math.isfinite(float(reward))


def _labelled(p: Prompt) -> bool:
    """A row that gives the reward model a label: a finite logged reward, or a correction."""
    return _rated(p) or correction_text(p) is not None


def feedback_data(
    rows: Sequence[Prompt],
    *,
    max_user_share: float = 1.0,
    max_key_share: float = 1.0,
    positives_from: Literal["any", "explicit"] = "any",
) -> FeedbackData:
    """Labelled examples and preference pairs (feedback pairs, then correction pairs) of one split.

    The rows that carry a label (a reward or a correction) are capped per API key and per user as the
    split is (:func:`capped_rows`): a client whose rows are all rated, among clients who rarely rate,
    holds at most its share of the reward model's labels, not only of the round's rows. With
    ``positives_from = "explicit"``, see :func:`_explicit_feedback`."""
    if positives_from == "explicit":
        return _explicit_feedback(rows, max_user_share, max_key_share)
    rows = list(rows)
    if max_user_share < 1.0 or max_key_share < 1.0:
        labelled = [i for i, p in enumerate(rows) if _labelled(p)]
        kept = set(capped_prompts(rows, max_user_share, max_key_share, keep=labelled))
        rows = [p for i, p in enumerate(rows) if i in kept]
    examples = labelled_examples(rows)
    return FeedbackData(tuple(examples), tuple(feedback_pairs(examples) + correction_pairs(rows)))


def _explicit_feedback(rows: Sequence[Prompt], max_user_share: float, max_key_share: float) -> FeedbackData:
    """The labels of :func:`explicit_rows`: every correction a positive example of its own, so it also pairs
    with its prompt's negatives. The cap counts examples (a correction once, as its own row), and a
    correction's pair (correction ≻ the answer it corrected) stays with its example."""
    expanded = explicit_rows(rows)
    rated = [i for i, p in enumerate(expanded) if _rated(p)]
    kept = [expanded[i] for i in capped_prompts(expanded, max_user_share, max_key_share, keep=rated)]
    corrections = {p.prompt_id for p in kept if p.logged_reward_source == CORRECTION_SOURCE}
    corrected = [p for p in rows if (c := correction_row(p)) is not None and c.prompt_id in corrections]
    examples = labelled_examples(kept)
    return FeedbackData(tuple(examples), tuple(feedback_pairs(examples) + correction_pairs(corrected)))


# --- the data preparation step ------------------------------------------------------------------


def prepare_round_data(
    train: pa.Table, heldout: pa.Table, *, max_user_share: float = 1.0, max_key_share: float = 1.0
) -> RoundData:
    """Read a round's train and held-out tables once: prompts, feedback (its labels capped per key and per
    user, :func:`feedback_data`), window, per-user and per-key metrics.

    Raises:
        DataError: a required column is missing, or a row's prompt/metadata is unreadable.
        NotEnoughDataError: the held-out table is empty.
    """
    train_rows, heldout_rows = prompts_from_table(train), prompts_from_table(heldout)
    if not heldout_rows:
        raise NotEnoughDataError("the held-out table is empty; widen the window or lower [rl.split] heldout_fraction")
    window_start, window_end = _window(train, heldout)
    return RoundData(
        train=tuple(train_rows),
        heldout=tuple(heldout_rows),
        train_feedback=feedback_data(train_rows, max_user_share=max_user_share, max_key_share=max_key_share),
        heldout_feedback=feedback_data(heldout_rows, max_user_share=max_user_share, max_key_share=max_key_share),
        window_start=window_start,
        window_end=window_end,
        metrics={**user_metrics(train_rows, heldout_rows), **label_metrics(train, heldout)},
    )


def label_metrics(train: pa.Table, heldout: pa.Table) -> dict[str, float]:
    """``{data/labels/<signal>: rows}``: how many of the round's rows each feedback signal labelled (the parts
    of the snapshot's ``reward_source``: ``thumbs``, ``rating``, the implicit ``continued``, ``rephrased``...;
    a reward from two signals counts for both). Empty when the tables have no ``reward_source``."""
    counts: Counter[str] = Counter()
    for table in (train, heldout):
        if "reward_source" in table.column_names:
            for source in table.column("reward_source").to_pylist():
                counts.update(source.split("+") if source else ())
    return {f"data/labels/{name}": float(n) for name, n in sorted(counts.items())}


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
