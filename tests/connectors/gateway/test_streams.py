"""The gateway's memory of streamed answers that may not take feedback (pure logic, a fake clock)."""

from __future__ import annotations

from connectors.gateway.streams import StreamLedger


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_stream_is_streaming_until_it_completes_or_fails() -> None:
    ledger = StreamLedger(ttl_s=60, clock=Clock())
    ledger.start("ok")
    ledger.start("cut")
    assert ledger.state("ok") == ledger.state("cut") == "streaming"

    ledger.complete("ok")
    assert ledger.end("ok") is False and ledger.state("ok") is None  # completed: feedback welcome
    assert ledger.end("cut") is True and ledger.state("cut") == "failed"
    assert ledger.state("never-streamed") is None


def test_failed_ids_are_forgotten_after_the_token_lifetime_and_bounded() -> None:
    clock = Clock()
    ledger = StreamLedger(ttl_s=60, max_failed=2, clock=clock)
    for trace_id in ("a", "b"):
        ledger.start(trace_id)
        ledger.end(trace_id)
    clock.now += 30
    ledger.start("c")
    ledger.end("c")  # at the cap: the oldest failed id goes first
    assert [ledger.state(t) for t in ("a", "b", "c")] == [None, "failed", "failed"]

    clock.now += 31  # b's token lifetime is over (the token itself is refused from now on)
    assert [ledger.state(t) for t in ("b", "c")] == [None, "failed"]
    ledger.start("d")
    ledger.end("d")  # expired ids are dropped on the way
    assert list(ledger._failed) == ["c", "d"]
