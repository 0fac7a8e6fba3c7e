"""Unit tests of how the ingest worker cuts polled records into commit batches."""

from __future__ import annotations

from collections import namedtuple

from kafka import TopicPartition

from connectors.ingest import _next_offsets, _split_batch

Rec = namedtuple("Rec", "offset")
A, B = TopicPartition("traces", 0), TopicPartition("traces", 1)


def test_split_keeps_partition_order_and_commits_only_what_the_batch_holds() -> None:
    pending = {A: [Rec(o) for o in range(10, 16)], B: [Rec(o) for o in range(3)]}
    batch, rest = _split_batch(pending, 4)
    assert {tp: [r.offset for r in rs] for tp, rs in batch.items()} == {A: [10, 11, 12, 13]}
    assert {tp: [r.offset for r in rs] for tp, rs in rest.items()} == {A: [14, 15], B: [0, 1, 2]}
    assert {tp: m.offset for tp, m in _next_offsets(batch).items()} == {A: 14}  # not past 13: 14 is not stored yet
    second, left = _split_batch(rest, 4)
    assert {tp: [r.offset for r in rs] for tp, rs in second.items()} == {A: [14, 15], B: [0, 1]}
    assert {tp: m.offset for tp, m in _next_offsets(second).items()} == {A: 16, B: 2}
    assert {tp: [r.offset for r in rs] for tp, rs in left.items()} == {B: [2]}


def test_split_of_a_small_batch_takes_everything() -> None:
    pending = {A: [Rec(1)], B: [Rec(7), Rec(8)]}
    batch, rest = _split_batch(pending, 4)
    assert batch == pending and rest == {}
