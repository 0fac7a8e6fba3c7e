"""Verifiable prompts (reasoning-gym) and buffer snapshots as training prompts.

Snapshot tables carry the buffer's columns: ``trace_id`` string, ``ts``
timestamp, ``model`` string, ``adapter_version`` string, ``prompt`` string
(JSON chat messages), ``completion`` string, ``completion_token_ids``
list<int32> (nullable), ``completion_logprobs`` list<float32> (nullable),
``reward`` float64 (nullable), ``metadata`` string (JSON object).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow as pa

from trainer.errors import DataError
from trainer.samples import Prompt

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
ANSWER_ONLY = "Answer with the number only."


def reasoning_gym_prompts(
    task: str = "basic_arithmetic", n: int = 32, seed: int = 0, *, instruction: str = ANSWER_ONLY, **task_kwargs: Any
) -> list[Prompt]:
    """``n`` verifiable chat prompts from a reasoning-gym task (offline, seeded).

    Each prompt is one user message (question + ``instruction``) with
    ``metadata["reference_answer"]`` = reasoning-gym's answer string.
    Example: ``reasoning_gym_prompts("basic_arithmetic", 16, min_terms=2,
    max_terms=2, min_digits=1, max_digits=1)``.
    """
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=n, seed=seed, **task_kwargs)
    prompts = []
    for i, item in enumerate(dataset):
        content = f"{item['question']} {instruction}".strip()
        prompts.append(
            Prompt(
                prompt_id=f"{task}-{seed}-{i}",
                messages=[{"role": "user", "content": content}],
                metadata={"reference_answer": str(item["answer"]), "task": task},
            )
        )
    return prompts


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
    return pa.Table.from_pydict(rows, schema=SNAPSHOT_SCHEMA)


def _text_content(content: Any) -> str:
    """A message's content as the text a chat template takes: OpenAI content parts -> their ``text``
    parts joined by newlines (other parts, e.g. images, dropped), null or missing -> "" (the buffer
    stores ``"content": null`` messages, e.g. an assistant turn with tool calls, without the key)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
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
    raise DataError(f"row {trace_id!r}: prompt must be JSON chat messages [{{role, content}}] or text; got {raw[:80]!r}")


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
        out.append(
            Prompt(
                prompt_id=trace_id,
                messages=_messages(row["prompt"], trace_id),
                metadata=metadata,
                logged_completion=row.get("completion"),
                logged_token_ids=row.get("completion_token_ids"),
                logged_logprobs=row.get("completion_logprobs"),
                logged_reward=row.get("reward"),
                logged_adapter_version=row.get("adapter_version"),
            )
        )
    return out


def split_snapshot(table: pa.Table, heldout_fraction: float) -> tuple[pa.Table, pa.Table]:
    """``(train, heldout)`` split by time: the newest ``heldout_fraction`` of rows is held out.

    Both parts keep at least one row when the table has two or more.

    Raises:
        DataError: fraction outside (0, 1), no ``ts`` column, or fewer than 2 rows.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction {heldout_fraction} must lie in (0, 1)")
    if "ts" not in table.column_names:
        raise DataError(f"snapshot table has no 'ts' column to split by time; columns: {table.column_names}")
    if table.num_rows < 2:
        raise DataError(f"snapshot has {table.num_rows} rows; a train/held-out split needs at least 2")
    ordered = table.sort_by([("ts", "ascending"), ("trace_id", "ascending")])
    n_heldout = min(max(1, round(table.num_rows * heldout_fraction)), table.num_rows - 1)
    cut = table.num_rows - n_heldout
    return ordered.slice(0, cut), ordered.slice(cut)
