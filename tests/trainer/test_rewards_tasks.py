"""Reward functions, the reward mix, prompts from snapshots and the time split."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from trainer.config import RewardTerm
from trainer.errors import DataError, RewardError
from trainer.rewards import build_reward, exact_answer, format_reward, json_valid, length_penalty
from trainer.types import Prompt
from trainer.data import prompts_from_table, snapshot_table, split_snapshot
from trainer.tasks import reasoning_gym_prompts

MSG = [{"role": "user", "content": "2+2?"}]


def test_builtin_rewards() -> None:
    assert exact_answer(MSG, "The answer is 4.", {"reference_answer": "4"}) == 1.0
    assert exact_answer(MSG, "4.0", {"reference_answer": "4"}) == 1.0
    assert exact_answer(MSG, "I think 5", {"reference_answer": "4"}) == 0.0
    assert exact_answer(MSG, "-3", {"reference_answer": "-3"}) == 1.0
    with pytest.raises(RewardError, match="reference_answer"):
        exact_answer(MSG, "4", {})
    assert json_valid(MSG, '```json\n{"a": 1}\n```', {}) == 1.0 and json_valid(MSG, "{a: 1}", {}) == 0.0
    assert length_penalty(MSG, "x" * 30, {}, target_chars=10, per_char=0.1) == pytest.approx(-2.0)
    assert format_reward(MSG, "4", {}) == 1.0 and format_reward(MSG, "four", {}) == 0.5
    assert format_reward(MSG, "well the answer is 4", {}) == 0.0


def test_weighted_mix_import_paths_and_logged() -> None:
    mix = build_reward(
        [
            RewardTerm(fn="exact_answer", weight=2.0),
            RewardTerm(fn="trainer.rewards:json_valid", weight=0.5),
            RewardTerm(fn="logged", weight=1.0),
        ]
    )
    assert mix(MSG, "4", {"reference_answer": "4", "reward": -1.0}) == pytest.approx(2.0 + 0.5 - 1.0)
    with pytest.raises(RewardError, match="fresh rollouts have none"):
        mix(MSG, "4", {"reference_answer": "4"})
    eval_mix = build_reward([RewardTerm(fn="logged")], skip_logged=True)
    assert not eval_mix
    with pytest.raises(ValueError, match="unknown reward 'nope'"):  # caught when the config is validated
        RewardTerm(fn="nope")
    with pytest.raises(RewardError, match="cannot be imported"):
        build_reward([RewardTerm(fn="trainer.rewards:missing")])


def test_reasoning_gym_prompts_are_verifiable() -> None:
    prompts = reasoning_gym_prompts("basic_arithmetic", 5, seed=3, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert len(prompts) == 5 and len({p.prompt_id for p in prompts}) == 5
    for p in prompts:
        assert p.messages[0]["role"] == "user"
        assert exact_answer(p.messages, f"= {p.metadata['reference_answer']}", p.metadata) == 1.0


def test_snapshot_round_trip_and_time_split() -> None:
    start = datetime(2026, 3, 1, tzinfo=timezone.utc)
    prompts = [
        Prompt(
            prompt_id=f"t{i}",
            messages=[{"role": "user", "content": f"q{i}"}],
            metadata={"reference_answer": str(i)},
            logged_completion=str(i),
            logged_token_ids=[5, 6],
            logged_logprobs=[-0.5, -0.25],
            logged_reward=float(i),
        )
        for i in range(10)
    ]
    table = snapshot_table(prompts[::-1], start=start)  # newest row first in the table: t0 is newest
    train, heldout = split_snapshot(table, 0.2)
    assert (train.num_rows, heldout.num_rows) == (8, 2)
    assert max(train.column("ts").to_pylist()) < min(heldout.column("ts").to_pylist())
    assert set(heldout.column("trace_id").to_pylist()) == {"t1", "t0"}
    back = {p.prompt_id: p for p in prompts_from_table(table)}
    assert back["t3"].logged_logprobs == pytest.approx([-0.5, -0.25]) and back["t3"].logged_reward == 3.0
    assert back["t3"].metadata == {"reference_answer": "3"}
    with pytest.raises(DataError, match="at least 2"):
        split_snapshot(table.slice(0, 1), 0.5)


def test_bad_rows_are_reported_with_their_trace_id() -> None:
    table = snapshot_table([Prompt(prompt_id="ok", messages=MSG)])
    bad = table.set_column(table.column_names.index("metadata"), "metadata", [["[1, 2]"]])
    with pytest.raises(DataError, match="row 'ok': metadata must be a JSON object"):
        prompts_from_table(bad)
    plain = table.set_column(table.column_names.index("prompt"), "prompt", [[json.dumps("just text")]])
    assert prompts_from_table(plain)[0].messages == [{"role": "user", "content": "just text"}]
    with pytest.raises(DataError, match="lacks columns"):
        prompts_from_table(table.drop_columns(["prompt"]))


def test_every_prompt_form_ingest_accepts_is_readable_as_chat_messages(tmp_path) -> None:
    """Ingest accepts OpenAI message forms the chat template cannot take as is (content null or missing,
    content parts, extra keys, no message at all). One such trace in the window must not fail the round
    (``prompts_from_table`` raising for the whole snapshot): each becomes text-only messages."""
    from connectors import schema as s
    from connectors.buffer import RewardBuffer
    from connectors.config import BufferConfig
    from connectors.segments import Coordinates

    now = datetime.now(timezone.utc)
    forms = {
        "null": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}],
        "parts": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "text", "text": "b"},
                ],
            }
        ],
        "named": [{"role": "user", "content": "x", "name": "n"}],
        "empty": [],
        "text": "plain",
    }
    hasher = s.UserHasher("k" * 16, ["user"])
    events = []
    for i, (name, prompt) in enumerate(forms.items()):
        raw = json.dumps(
            {
                "schema": s.TRACE_SCHEMA,
                "trace_id": name,
                "ts": now.isoformat(),
                "model": "m",
                "prompt": prompt,
                "completion": "c",
                "thumbs": "up",
            }
        ).encode()
        event = s.parse_record(raw, max_record_bytes=1 << 20, hasher=hasher)
        assert isinstance(event, s.TraceEvent), event  # ingest accepts every form
        events.append((event, Coordinates("traces", 0, i)))
    cfg = BufferConfig(root=str(tmp_path / "buf"), dead_letter_root=str(tmp_path / "dlq"))
    RewardBuffer(cfg).append(events, [])
    got = {p.prompt_id: p.messages for p in prompts_from_table(RewardBuffer(cfg).snapshot())}
    assert got == {
        "null": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}],
        "parts": [{"role": "user", "content": "a\nb"}],
        "named": [{"role": "user", "content": "x", "name": "n"}],
        "empty": [],
        "text": [{"role": "user", "content": "plain"}],
    }


def test_json_valid_scores_an_answer_nested_past_the_parser_as_not_json() -> None:
    """Found by a red-team pass: a degenerate candidate answering ``[[[[...`` (a thousand brackets) made json_valid
    raise RecursionError, out of the reward, the monitors' format mix and a regression suite's check."""
    assert json_valid(MSG, "[" * 5000 + "]" * 5000, {}) == 0.0
    assert json_valid(MSG, "[" * 50 + "]" * 50, {}) == 1.0


def test_a_built_in_rewards_unknown_keyword_is_a_config_error() -> None:
    """Found by a red-team pass: `kwargs = {bogus = 1}` on a built-in reward passed `hourglass config check` and
    failed only when a round first scored a rollout."""
    import pydantic

    from trainer.config import RewardTerm

    with pytest.raises(pydantic.ValidationError, match="bogus"):
        RewardTerm(fn="exact_answer", kwargs={"bogus": 1})
    assert RewardTerm(fn="length_penalty", kwargs={"target_chars": 10}).kwargs == {"target_chars": 10}
    assert RewardTerm(fn="reward_model", kwargs={"probability": False}).fn == "reward_model"
