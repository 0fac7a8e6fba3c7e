"""Hostile route records: whatever a Kafka producer writes to the routes topic, the gateway's resolver
keeps answering with the last good route (no TypeError, no huge allocation, no dead follower thread),
and a record can only name ``<model>-v<version>``, the served names of the routes contract."""

from __future__ import annotations

import json
import os
import threading

import pytest

from connectors.config import KafkaConfig
from connectors.gateway.route_feed import REFUSED, RouteFollower
from connectors.gateway import routes as routes_module
from connectors.gateway.routes import (
    ROUTES_FILE,
    Route,
    RouteRecordError,
    RouteResolver,
    read_routes,
    remove_route,
    route_from_dict,
    write_route,
)

GOOD = {"served_name": "hg-v2", "version": "2", "updated_at": "2026-01-01T00:00:00+00:00"}
CANARY = {**GOOD, "challenger_served_name": "hg-v3", "challenger_version": "3", "fraction": 0.5}


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({**CANARY, "fraction": "0.5"}, "fraction"),  # was "0.5" * 10000 then int < str: TypeError, a 500
        ({**CANARY, "fraction": "x" * 100_000}, "fraction"),  # was a 1 GB string built per request
        ({**CANARY, "fraction": None}, "fraction"),
        ({**CANARY, "fraction": True}, "fraction"),
        ({**CANARY, "fraction": 1.5}, "fraction"),
        ({**CANARY, "fraction": float("nan")}, "fraction"),
        ({**GOOD, "version": 2}, "version"),
        ({**GOOD, "served_name": "base", "version": None}, "version"),  # a forged "back to the base"
        ({**GOOD, "updated_at": None}, "updated_at"),
        ({**GOOD, "served_name": "../../etc/passwd"}, "served_name"),
        ({**GOOD, "served_name": ""}, "served_name"),
        ({**CANARY, "challenger_version": None}, "challenger"),
        ({**CANARY, "challenger_version": "\ud800"}, "challenger_version"),  # was a UnicodeEncodeError per request
        ({**CANARY, "challenger_version": "3\n"}, "challenger_version"),
        ({**GOOD, "served_name": "hg-v2\n"}, "served_name"),
        ([GOOD], "JSON object"),
    ],
)
def test_route_entries_with_a_wrong_field_are_refused_naming_it(entry: object, field: str) -> None:
    with pytest.raises(RouteRecordError, match=field):
        route_from_dict(entry)


def test_a_record_may_only_name_the_versioned_served_name_of_its_model() -> None:
    assert route_from_dict(CANARY, "hg").challenger_served_name == "hg-v3"
    with pytest.raises(RouteRecordError, match="expected hg-v2"):
        route_from_dict({**GOOD, "served_name": "grpo-s3"}, "hg")  # a rollout adapter as the champion
    with pytest.raises(RouteRecordError, match="expected hg-v3"):
        route_from_dict({**CANARY, "challenger_served_name": "other-v3"}, "hg")


def test_hostile_records_leave_the_last_good_route_and_the_follower_alive() -> None:
    follower = RouteFollower(KafkaConfig())
    follower._apply(b"hg", json.dumps(CANARY).encode())
    resolver = RouteResolver(None, "hg", "base", ttl_s=0.0, source=follower.routes)
    before = REFUSED._value.get()
    hostile = [
        json.dumps({**CANARY, "fraction": "0.5"}).encode(),
        json.dumps({**GOOD, "served_name": "grpo-s3"}).encode(),
        b"[" * 5000,  # deeper than the JSON parser's recursion limit: RecursionError ended the thread
        b"\xff\xfe",
    ]
    for value in hostile:
        follower._apply(b"hg", value)  # must not raise
    assert REFUSED._value.get() - before == len(hostile)
    assert resolver.route("hg", "user-a").served_name in ("hg-v2", "hg-v3")
    assert follower.routes()["hg"] == CANARY


def test_a_damaged_routes_file_entry_is_left_out_not_raised(tmp_path) -> None:
    (tmp_path / ROUTES_FILE).write_text(
        json.dumps({"hg": GOOD, "bad": {**GOOD, "extra_from_a_newer_writer": 1, "fraction": "0.2"}, "odd": 7})
    )
    assert list(read_routes(tmp_path)) == ["hg"]
    resolver = RouteResolver(tmp_path, "hg", "base", ttl_s=0.0)
    assert resolver("hg") == ("hg-v2", "2")
    (tmp_path / ROUTES_FILE).write_text("[1, 2]")  # valid JSON, not an object: was AttributeError
    assert read_routes(tmp_path) == {}


def test_a_routes_file_entry_that_names_another_models_served_name_is_left_out(tmp_path) -> None:
    """The routes file holds the routes topic's contract: ``hg`` may only route to ``hg-v<number>`` (it used to
    accept any plain name, so an edited file could send ``hg``'s traffic to another model's adapter; a version
    such as ``1-v3`` makes ``hg-v1-v3``, version 3 of a model named ``hg-v1``)."""
    (tmp_path / ROUTES_FILE).write_text(
        json.dumps(
            {
                "hg": {**GOOD, "served_name": "hg-oracle-v2"},
                "hg-oracle": {**CANARY, "served_name": "hg-oracle-v2", "challenger_served_name": "hg-v3"},
                "hg-v1": {**GOOD, "served_name": "hg-v1-v3", "version": "1-v3"},
                "hg-v2": {
                    **CANARY,
                    "served_name": "hg-v2-v2",
                    "challenger_served_name": "hg-v2-v1-v3",
                    "challenger_version": "1-v3",
                },
                "kept": {**GOOD, "served_name": "kept-v2"},
            }
        )
    )
    assert list(read_routes(tmp_path)) == ["kept"]
    resolver = RouteResolver(tmp_path, "hg", "base", ttl_s=0.0)
    assert resolver("hg") == ("base", None)
    (tmp_path / ROUTES_FILE).write_text(json.dumps({"hg": {**GOOD, "served_name": "hg-v1-v3", "version": "1-v3"}}))
    assert resolver("hg") == ("base", None)
    with pytest.raises(RouteRecordError, match="MLflow number"):
        route_from_dict({**GOOD, "served_name": "hg-v1-v3", "version": "1-v3"}, "hg")


def test_a_routes_file_nested_too_deep_reads_as_no_routes(tmp_path) -> None:
    """JSON nested deeper than the parser goes raised RecursionError from ``read_routes``: every request through
    the gateway, and every route write of the controller, failed until the file was repaired."""
    for text in ("[" * 200_000 + "]" * 200_000, '{"hg": ' + "[" * 200_000 + "]" * 200_000 + "}"):
        (tmp_path / ROUTES_FILE).write_text(text)
        assert read_routes(tmp_path) == {}
        assert RouteResolver(tmp_path, "hg", "base", ttl_s=0.0)("hg") == ("base", None)


def test_routes_for_names_this_deployment_does_not_serve_are_ignored() -> None:
    follower = RouteFollower(KafkaConfig())
    follower._apply(b"hg", json.dumps(GOOD).encode())
    follower._apply(b"evil", json.dumps({**GOOD, "served_name": "evil-v2"}).encode())  # valid, but not ours
    resolver = RouteResolver(None, "hg", "base", ttl_s=0.0, source=follower.routes, models={"hg", "hg-oracle"})
    assert resolver.names() == ["hg"]  # was ["evil", "hg"]: a producer could add public model names
    with pytest.raises(KeyError, match="evil"):
        resolver.route("evil", "k")
    assert RouteResolver(None, "hg", "base", ttl_s=0.0, source=follower.routes).names() == ["evil", "hg"]


def test_a_base_side_route_is_kept_only_beside_a_challenger_and_only_for_this_gateways_base() -> None:
    """A canary against the base (no champion yet) routes the rest of the traffic to the base: a record with
    ``version`` null is valid beside a challenger, and the gateway keeps it only when its served name is the
    gateway's own base; one that points the base side at another served name falls back to the base."""
    base_canary = {**CANARY, "served_name": "base", "version": None}
    assert route_from_dict(base_canary, "hg").version is None
    follower = RouteFollower(KafkaConfig())
    follower._apply(b"hg", json.dumps(base_canary).encode())
    resolver = RouteResolver(None, "hg", "base", ttl_s=0.0, source=follower.routes)
    keys = [f"user-{i}" for i in range(200)]
    sides = {resolver.route("hg", k) for k in keys}
    assert {(s.served_name, s.version) for s in sides} == {("base", None), ("hg-v3", "3")}
    forged = {**base_canary, "served_name": "hg-oracle-v9"}  # a valid name, but not this gateway's base
    follower._apply(b"hg", json.dumps(forged).encode())
    assert {resolver.route("hg", k).served_name for k in keys} == {"base"}  # the route is dropped: all base


def test_a_huge_key_does_not_make_a_huge_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Found by a red-team pass: the refusal reason quotes the model name, so a 1 MiB key logged 1 MiB."""
    follower = RouteFollower(KafkaConfig(bootstrap_servers=["127.0.0.1:9"]))
    before = REFUSED._value.get()
    with caplog.at_level("WARNING", logger="connectors.gateway.route_feed"):
        follower._apply(
            b"m" * 1_000_000, json.dumps({"served_name": "x-v1", "version": "1", "updated_at": "t"}).encode()
        )
    assert REFUSED._value.get() == before + 1 and follower.routes() == {}
    assert caplog.records and all(len(r.getMessage()) < 2000 for r in caplog.records)


def test_a_routes_file_with_an_unencodable_challenger_version_keeps_every_request_answered(tmp_path) -> None:
    """JSON allows a lone surrogate; the resolver hashes the challenger's version into every routing decision,
    so such an entry is left out (the public name falls back to the base) instead of failing each request."""
    (tmp_path / ROUTES_FILE).write_text(json.dumps({"hg": {**CANARY, "challenger_version": "\ud800"}}))
    resolver = RouteResolver(tmp_path, "hg", "base", ttl_s=0.0)
    assert resolver.route("hg", "hmac-sha256:ab") == ("base", None, None)


def test_a_refused_routes_file_entry_is_logged_once_with_its_reason(tmp_path, caplog) -> None:
    """A hand-edited routes file whose entry breaks the contract was left out in silence: the model answered
    from the base and nothing said why. Now the resolver warns once per refused entry (not once per read)."""
    resolver = RouteResolver(tmp_path, "hg", "base", ttl_s=0.0)
    bad = {"hg": {**GOOD, "served_name": "other-v2"}, "big": {**GOOD, "served_name": "big-v2"}, "x" * 10_000: 7}
    (tmp_path / ROUTES_FILE).write_text(json.dumps(bad))
    with caplog.at_level("WARNING", logger="connectors.gateway.routes"):
        for _ in range(5):
            assert resolver("hg") == ("base", None)
            assert resolver("big") == ("big-v2", "2")  # the valid entry beside them still routes
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert any("'other-v2'" in m and "expected hg-v2" in m for m in messages)
    assert any("not a JSON object" in m for m in messages) and all(len(m) < 1000 for m in messages)
    caplog.clear()
    (tmp_path / ROUTES_FILE).write_text(json.dumps({"hg": {**GOOD, "served_name": "base", "version": None}}))
    with caplog.at_level("WARNING", logger="connectors.gateway.routes"):
        assert resolver("hg") == ("base", None)
        assert resolver("hg") == ("base", None)
    assert len(caplog.records) == 1 and "version" in caplog.records[0].getMessage()  # a new reason warns again


def test_a_routes_file_of_many_bad_entries_logs_a_bounded_number_of_lines(tmp_path, caplog, monkeypatch) -> None:
    """5,000 bad entries, or a file rewritten with a new bad value before every read, log 21 lines a window;
    the entries not listed yet are listed in the next window, and an entry listed once is not listed again."""
    clock = [1000.0]
    monkeypatch.setattr(routes_module.time, "monotonic", lambda: clock[0])
    resolver = RouteResolver(tmp_path, "hg", "base", ttl_s=0.0)
    (tmp_path / ROUTES_FILE).write_text(json.dumps({f"m{i:04}": 7 for i in range(25)}))
    with caplog.at_level("WARNING", logger="connectors.gateway.routes"):
        for i in range(50):
            (tmp_path / ROUTES_FILE).write_text(
                json.dumps({f"m{i:04}": 7 for i in range(25)} | {"hg": {**GOOD, "served_name": f"x{i}-v2"}})
            )
            assert resolver("hg") == ("base", None)
    assert len(caplog.records) == 21 and caplog.records[-1].getMessage().startswith("6 more routes left out")
    assert "'x0-v2'" in caplog.records[0].getMessage()
    caplog.clear()
    clock[0] += 61
    with caplog.at_level("WARNING", logger="connectors.gateway.routes"):
        assert resolver("hg") == ("base", None)
    listed = sorted(r.getMessage()[len("route left out: route of '") :][:5] for r in caplog.records)
    assert listed == ["hg': ", "m0019", "m0020", "m0021", "m0022", "m0023", "m0024"], listed
    assert "'x49-v2'" in caplog.records[0].getMessage()  # hg's latest reason, not the 49 before it
    caplog.clear()
    (tmp_path / ROUTES_FILE).write_text(json.dumps({f"m{i}": 7 for i in range(5000)}))
    clock[0] += 61
    with caplog.at_level("WARNING", logger="connectors.gateway.routes"):
        for _ in range(3):
            assert resolver("hg") == ("base", None)
    assert len(caplog.records) == 21 and caplog.records[-1].getMessage().startswith("4980 more routes left out")


def test_a_routes_file_that_does_not_parse_keeps_the_last_routes_and_forgets_no_earlier_warning(
    tmp_path, caplog, monkeypatch
) -> None:
    """A hand-edit with a trailing comma sent every model to the base with nothing logged; a moment of a
    half-written file then made every bad entry warn again."""
    clock = [1000.0]
    monkeypatch.setattr(routes_module.time, "monotonic", lambda: clock[0])
    resolver = RouteResolver(tmp_path, "hg", "base", ttl_s=0.0)
    good = json.dumps({"big": {**GOOD, "served_name": "big-v2"}, "bad": 7})
    (tmp_path / ROUTES_FILE).write_text(good)
    with caplog.at_level("INFO", logger="connectors.gateway.routes"):
        assert resolver("big") == ("big-v2", "2")
        for i in range(50):  # edited in place: a new parse error on every read, logged once
            (tmp_path / ROUTES_FILE).write_text(good[:-1] + "," + " " * i + "}")
            assert resolver("big") == ("big-v2", "2") and resolver("hg") == ("base", None)
        (tmp_path / ROUTES_FILE).write_text("[1]")
        assert resolver("big") == ("big-v2", "2") and resolver.names() == ["big", "hg"]
        clock[0] += 301  # still broken: said again, with how long
        assert resolver("big") == ("big-v2", "2")
        (tmp_path / ROUTES_FILE).write_text(json.dumps({"big": {**GOOD, "served_name": "big-v3", "version": "3"}}))
        assert resolver("big") == ("big-v3", "3")  # the next good read counts again
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4, messages  # 'bad' once, the broken file once and once more, its repair
    assert "'bad': not a JSON object" in messages[0]
    assert "unreadable" in messages[1] and messages[1].endswith("keeps the routes it read last until it parses")
    assert "is not a JSON object, for 301 s; the gateway keeps the routes it read last" in messages[2]
    assert messages[3] == "routes file parses again after 301 s"


def test_a_gateway_started_beside_a_routes_file_that_does_not_parse_serves_its_model_by_the_base(tmp_path) -> None:
    (tmp_path / ROUTES_FILE).write_text('{"hg": ')
    resolver = RouteResolver(tmp_path, "hg", "base", ttl_s=0.0)
    assert resolver("hg") == ("base", None) and resolver.names() == ["hg"]
    with pytest.raises(KeyError):
        resolver("big")
    (tmp_path / ROUTES_FILE).write_text(json.dumps({"hg": {**GOOD, "served_name": "hg-v2"}}))
    assert resolver("hg") == ("hg-v2", "2")


def test_refused_routes_of_models_this_gateway_does_not_serve_are_not_logged(tmp_path, caplog) -> None:
    (tmp_path / ROUTES_FILE).write_text(json.dumps({"other": 7, "hg": {**GOOD, "served_name": "other-v2"}}))
    with caplog.at_level("WARNING", logger="connectors.gateway.routes"):
        assert RouteResolver(tmp_path, "hg", "base", ttl_s=0.0, models={"hg"})("hg") == ("base", None)
    assert [r.getMessage()[:29] for r in caplog.records] == ["route left out: route of 'hg'"]


def test_a_routes_file_that_is_not_a_regular_file_or_too_large_reads_as_unparsable_at_once(tmp_path) -> None:
    """A FIFO at the routes file's path blocked every reader (the gateway's lock held) until someone wrote."""
    os.mkfifo(tmp_path / ROUTES_FILE)
    refused: dict = {}
    reader = threading.Thread(target=lambda: refused.update(x=read_routes(tmp_path, refused)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and refused["x"] == {} and "not a regular file" in refused[None]
    (tmp_path / ROUTES_FILE).unlink()
    (tmp_path / ROUTES_FILE).mkdir()
    assert read_routes(tmp_path, refused) == {} and "not a regular file" in refused[None]
    (tmp_path / ROUTES_FILE).rmdir()
    big = json.dumps({"hg": GOOD, "pad": "x" * routes_module.MAX_ROUTES_FILE_BYTES})
    (tmp_path / ROUTES_FILE).write_text(big)
    assert read_routes(tmp_path, refused) == {} and "larger than" in refused[None]
    with pytest.raises(RouteRecordError, match="larger than"):
        read_routes(tmp_path, strict=True)


def test_writing_a_route_over_a_routes_file_that_does_not_parse_is_refused_and_keeps_the_file(tmp_path) -> None:
    """The writer rebuilt the file from nothing: one stray comma cost every other model its route."""
    broken = json.dumps({"big": {**GOOD, "served_name": "big-v2"}, "hg": GOOD})[:-1] + ",}"
    (tmp_path / ROUTES_FILE).write_text(broken)
    with pytest.raises(RouteRecordError, match="unreadable"):
        write_route(tmp_path, "hg", Route("hg-v3", "3", "2026-01-02T00:00:00+00:00"))
    with pytest.raises(RouteRecordError, match="unreadable"):
        remove_route(tmp_path, "hg")
    assert (tmp_path / ROUTES_FILE).read_text() == broken
    (tmp_path / ROUTES_FILE).unlink()
    write_route(tmp_path, "hg", Route("hg-v3", "3", "2026-01-02T00:00:00+00:00"))  # absent: written afresh
    assert read_routes(tmp_path) == {"hg": Route("hg-v3", "3", "2026-01-02T00:00:00+00:00")}


def test_writing_one_models_route_keeps_another_models_hand_edited_entry_as_it_is(tmp_path) -> None:
    """The writer re-wrote only the entries a reader accepts: a hand-edited entry of another model (to be fixed
    by its owner) vanished on the next promotion of this one."""
    other = {"served_name": "other-v2", "version": "two", "updated_at": "2026-01-01T00:00:00+00:00"}
    (tmp_path / ROUTES_FILE).write_text(json.dumps({"other": other, "hg": GOOD}))
    write_route(tmp_path, "hg", Route("hg-v3", "3", "2026-01-02T00:00:00+00:00"))
    written = json.loads((tmp_path / ROUTES_FILE).read_text())
    assert written["other"] == other and written["hg"]["served_name"] == "hg-v3"
    refused: dict = {}
    assert set(read_routes(tmp_path, refused)) == {"hg"} and "'two'" in refused["other"]  # still refused, still there
    remove_route(tmp_path, "hg")
    assert json.loads((tmp_path / ROUTES_FILE).read_text()) == {"other": other}


def test_removing_a_route_removes_a_null_or_broken_entry_of_that_model(tmp_path) -> None:
    (tmp_path / ROUTES_FILE).write_text(json.dumps({"hg": None, "big": 7}))
    remove_route(tmp_path, "hg")
    remove_route(tmp_path, "big")
    assert json.loads((tmp_path / ROUTES_FILE).read_text()) == {}
