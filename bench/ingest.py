"""Ingest throughput: durable traces/s into the reward buffer vs raw kafka-python consume-only traces/s.

Same broker (a fresh Tansu started here unless --bootstrap is given), same
messages, measured side by side in one run. Both sides use a consumer group
with the same fetch settings (``connectors.ingest.fetch_settings``; the raw
side deserialises nothing) and are timed from the first record received to
the last one handled (durable: parsed, written, fsynced, renamed and
offset-committed). Each round measures raw then durable, on fresh consumer
groups. Last line: the ratio durable / raw (target >= 0.8), the median of the
per-round ratios over ``--rounds`` rounds (5 by default: on a shared 2-core host
one round's ratio can be off by +-40 % when other jobs burst).

    python bench/ingest.py [--traces 20000] [--rounds 5] [--bootstrap HOST:PORT]

``--parsers`` measures the two trace parsers instead, without a broker: the msgspec fast path
(``connectors/fast_parse.py``, with its fallback) against the pydantic reference
(``connectors/schema.py``, ``fast=False``) on the same valid records, side by side, and, on one hostile
record per dead-letter reason, the reason each gives and what msgspec alone says: can the fast one be
the strict one?

    python bench/ingest.py --parsers [--traces 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import msgspec
from kafka import KafkaConsumer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import writer  # noqa: E402

from connectors.config import BufferConfig, KafkaConfig  # noqa: E402
from connectors.ingest import IngestWorker, fetch_settings  # noqa: E402
from connectors.kafka_admin import ensure_topics  # noqa: E402
from connectors.schema import ChatMessage, TraceEvent  # noqa: E402
from connectors.sink import TraceSink  # noqa: E402


def _events(n: int) -> list[TraceEvent]:
    t0 = datetime.now(timezone.utc)
    return [
        TraceEvent(
            trace_id=f"bench-{i}",
            ts=t0 + timedelta(milliseconds=i),
            model="base",
            adapter_version="v1",
            prompt=[ChatMessage(role="user", content=f"What is {i} + {i % 7}? Answer with a number.")],
            completion=f"The answer is {i + i % 7}. " * 8,
            completion_token_ids=list(range(40)),
            completion_logprobs=[-0.25] * 40,
            thumbs="up" if i % 2 else None,
            metadata={"user_id": f"user-{i % 100}", "reference_answer": str(i + i % 7)},
        )
        for i in range(n)
    ]


def raw_consume(cfg: KafkaConfig, n: int) -> float:
    """kafka-python consume-only (group member, no parsing, no storage): records/s."""
    consumer = KafkaConsumer(
        cfg.traces_topic,
        bootstrap_servers=cfg.bootstrap_servers,
        group_id=f"raw-{uuid.uuid4().hex[:6]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=cfg.heartbeat_interval_ms,
        **fetch_settings(cfg),  # same fetching as the worker
    )
    seen, first = 0, 0.0
    while seen < n:
        for records in consumer.poll(timeout_ms=cfg.batch_timeout_ms, max_records=cfg.batch_max_records).values():
            first = first or time.time()
            seen += len(records)
    last = time.time()
    consumer.close(autocommit=False)
    return n / (last - first)


def durable_ingest(cfg: KafkaConfig, buffer: BufferConfig, n: int) -> tuple[float, int]:
    """IngestWorker: parse, hash, durable Arrow segments, offset commit: (records/s, records on the fast path)."""
    worker = IngestWorker(cfg.model_copy(update={"group_id": f"durable-{uuid.uuid4().hex[:6]}"}), buffer)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,))
    thread.start()
    # Check rarely: every wake-up of this thread takes the GIL from the worker's threads (measured here:
    # polling every 10 ms cost the durable side ~15 %). The window comes from the worker's own timestamps.
    while worker.stats().traces < n or worker.stats().commits < worker.stats().batches:
        time.sleep(0.25)
    stats = worker.stats()
    stop.set()
    thread.join()
    if stats.first_record_unix_s is None or stats.last_commit_unix_s is None:
        raise RuntimeError(
            f"the ingest worker committed {stats.commits} batch(es) but recorded no time window: {stats}"
        )
    return n / (stats.last_commit_unix_s - stats.first_record_unix_s), stats.fast_parsed


def _hostile(valid: dict) -> list[tuple[str, bytes | None]]:
    """One record per dead-letter reason the parser gives (and a schema violation per kind of field)."""

    def with_(**over: object) -> bytes:
        return json.dumps(valid | over).encode()

    deep = b"[" * 4000 + b"]" * 4000  # under the size cap, past the JSON parser's recursion limit
    return [
        ("valid", with_()),
        ("tombstone", None),
        ("oversize", with_(completion="x" * 20000)),
        ("not UTF-8", b'{"schema": "\xff"}'),
        ("invalid JSON", b'{"schema": '),
        ("lone surrogate", with_(completion="\ud800")),  # json.dumps escapes it: JSON text UTF-8 cannot encode
        ("not an object", b"[1, 2]"),
        ("unknown schema", with_(schema="hourglass.trace/v9")),
        ("rating as a string", with_(rating="5")),
        ("rating out of range", with_(rating=9)),
        ("thumbs as a bool", with_(thumbs=True)),
        ("extra field", with_(extra=1)),
        ("token id as a float", with_(completion_token_ids=[1.0, 2.0])),
        ("non-finite reward", with_(reward=1).replace(b'"reward": 1', b'"reward": 1e999')),
        ("ts far in the past", with_(ts="1999-01-01T00:00:00Z")),
        ("nesting too deep", deep),
    ]


def parsers(args: argparse.Namespace, recorder: writer.Recorder) -> None:
    """The two parsers side by side (see the module docstring): throughput, then reasons."""
    from connectors import fast_parse
    from connectors.schema import TsWindow, UserHasher

    @dataclass(frozen=True)
    class Record:
        topic: str
        partition: int
        offset: int
        key: bytes | None
        value: bytes | None

    hasher = UserHasher("bench-key-0123456789", ["user_id", "email"])
    now = datetime.now(timezone.utc)
    window = TsWindow.around(now, 7 * 86400.0, 300.0)

    def parse(batch: list, fast: bool, max_record_bytes: int = 4096) -> fast_parse.ParsedBatch:
        return fast_parse.parse_batch(batch, max_record_bytes=max_record_bytes, hasher=hasher, window=window, fast=fast)

    values = [e.to_json_bytes() for e in _events(args.traces)]
    records = [Record("t", 0, i, None, v) for i, v in enumerate(values)]
    fast, strict = [], []
    for _ in range(args.rounds):  # alternate, so drifting load hits both alike
        started = time.perf_counter()
        batch = parse(records, True)
        fast.append(len(records) / (time.perf_counter() - started))
        started = time.perf_counter()
        reference = parse(records, False)
        strict.append(len(records) / (time.perf_counter() - started))
        assert len(batch.traces) == len(reference.traces) == len(records) and not batch.dead_letters
    ratio = statistics.median(f / s for f, s in zip(fast, strict))
    print(f"fast path {statistics.median(fast):.0f} records/s, reference {statistics.median(strict):.0f} records/s")
    valid = json.loads(values[0])
    rows = []
    same = True
    for label, value in _hostile(valid):
        one = [Record("t", 0, 0, None, value)]
        by_fast = parse(one, True, 16384).dead_letters
        by_reference = parse(one, False, 16384).dead_letters
        reason = by_reference[0].reason if by_reference else "accepted"
        same &= [(d.reason, d.detail) for d in by_fast] == [(d.reason, d.detail) for d in by_reference]
        try:
            fast_parse._DECODER.decode(value or b"")
            alone = "accepts it"
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            alone = f"error: {str(err)[:70]}"
        except RecursionError:
            alone = "error: recursion"
        rows.append([label, reason, alone])
        print(f"{label:22s} reference: {reason:18s} msgspec alone: {alone}")
    recorder.write(
        "parsers",
        title=f"trace parsers on {len(records)} valid traces ({args.rounds} alternating rounds) and one hostile record "
        "per dead-letter reason",
        columns=["record", "dead-letter reason (reference; the fast path gives the same)", "msgspec alone"],
        rows=[
            [
                "valid traces, records/s",
                f"reference {statistics.median(strict):.0f}",
                f"fast {statistics.median(fast):.0f}",
            ]
        ]
        + rows,
        result=f"fast / reference = {ratio:.2f}x on valid traces; reasons and details identical: {same}; msgspec alone "
        "gives no reason codes (one decode error per record), so the reference stays the strict parser",
    )
    print(f"fast / reference: {ratio:.2f}x; same dead letters: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=20000)
    parser.add_argument(
        "--rounds", type=int, default=5, help="Alternating raw/durable measurements (odd: a true median)."
    )
    parser.add_argument("--bootstrap", default=None, help="Use this broker instead of starting Tansu.")
    parser.add_argument(
        "--parsers", action="store_true", help="Compare the fast and the reference trace parser (no broker)."
    )
    writer.add_arguments(parser)
    args = parser.parse_args()
    recorder = writer.Recorder("ingest", args)
    if args.parsers:
        parsers(args, recorder)
        return
    with tempfile.TemporaryDirectory() as tmp:
        service = None
        bootstrap = args.bootstrap
        if bootstrap is None:
            from pipeline.stack import broker_service, free_port  # bench may use the launcher; connectors do not

            service = broker_service("127.0.0.1", free_port(), Path(tmp) / "logs")
            service.start()
            bootstrap = f"127.0.0.1:{service.port}"
        try:
            tag = uuid.uuid4().hex[:6]
            cfg = KafkaConfig(
                bootstrap_servers=[bootstrap],
                traces_topic=f"bench-traces-{tag}",
                feedback_topic=f"bench-feedback-{tag}",
                partitions=3,
            )
            ensure_topics(cfg)
            events = _events(args.traces)
            with TraceSink(cfg) as sink:
                for event in events:
                    sink.send_trace(event)
                acked = sink.flush()
            size = sum(len(e.to_json_bytes()) for e in events) / len(events)
            del events  # 20k pydantic events (~160k GC-tracked objects) would slow every full GC pass of both sides
            gc.collect()
            print(f"produced {acked} traces ({size:.0f} B each) to {cfg.traces_topic} on {bootstrap}")
            buffer = BufferConfig(root=str(Path(tmp) / "buffer"), dead_letter_root=str(Path(tmp) / "dlq"))
            raws, durables = [], []
            for i in range(args.rounds):  # alternate, so drifting load on a shared machine hits both sides alike
                raws.append(raw_consume(cfg, acked))
                durable, fast = durable_ingest(
                    cfg, buffer.model_copy(update={"root": str(Path(tmp) / f"buffer-{i}")}), acked
                )
                durables.append(durable)
                print(
                    f"round {i}: raw {raws[-1]:.0f} traces/s, durable {durable:.0f} traces/s "
                    f"({fast} on the fast path), ratio {durable / raws[-1]:.3f}"
                )
            raw, durable = statistics.median(raws), statistics.median(durables)
            ratio = statistics.median(d / r for d, r in zip(durables, raws))
            print(
                json.dumps(
                    {
                        "bench/raw_consume_traces_per_s": round(raw),
                        "bench/durable_traces_per_s": round(durable),
                        "bench/rounds": args.rounds,
                        **fetch_settings(cfg),
                    }
                )
            )
            recorder.write(
                "tansu" if service is not None else "external-broker",
                title=f"{acked} traces of {size:.0f} B, {'own Tansu broker' if service else 'broker ' + bootstrap}, "
                f"{args.rounds} alternating rounds",
                columns=["round", "raw consume, traces/s", "durable ingest, traces/s", "durable / raw"],
                rows=[[i, f"{r:.0f}", f"{d:.0f}", f"{d / r:.3f}"] for i, (r, d) in enumerate(zip(raws, durables))]
                + [["median", f"{raw:.0f}", f"{durable:.0f}", f"**{ratio:.3f}**"]],
                result=f"durable / raw = {ratio:.3f} (median of per-round ratios; target >= 0.8)",
            )
            print(f"raw kafka-python consume-only: {raw:10.0f} traces/s (median of {args.rounds})")
            print(f"durable ingest into buffer:    {durable:10.0f} traces/s (median of {args.rounds})")
            print(f"durable/raw ratio (median of per-round ratios): {ratio:.3f}")
        finally:
            if service is not None:
                service.stop()


if __name__ == "__main__":
    main()
