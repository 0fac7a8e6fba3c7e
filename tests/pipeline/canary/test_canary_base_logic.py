"""A model with no ``@champion`` yet: its first winner goes through a canary against the base model.

Unit tests of the control logic with the in-memory fakes (registry, replicas, staging) and a real
reward buffer in a temporary folder (no broker, MLflow or vLLM): the round's winner becomes
``@challenger``, the route splits the base and the challenger, the monitor compares the challenger with
the base's traces (``adapter_version`` null) and promotes or aborts; the base is never unloaded; rollback
and the operator commands say what they do in that state. The same path on real components:
``test_canary.py::test_first_winner_goes_through_a_canary_against_the_base``.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from connectors.buffer import RewardBuffer
from connectors.gateway.routes import Route, RouteResolver, read_routes, routes_from_dicts
from connectors.schema import TraceEvent
from connectors.segments import Coordinates
from pipeline.canary import state
from pipeline.canary.monitor import CanaryMonitor
from pipeline.canary.ops import end_canary
from pipeline.config import HourglassConfig
from pipeline.registry import aliases
from pipeline.registry.aliases import TAG_SERVE_ERROR
from pipeline.registry.client import RegistryError
from pipeline.serving.controller import ServingController
from tests.pipeline.registry_fakes import FakeRegistry, FakeReplica, FakeStager

MODEL = "hourglass"
BASE = "base-llm"  # serving.base_served_name here (the fake replicas list "base" too: never touched either)


class Stack:
    """Controller + monitor over two fake replicas and a fake registry with three versions; a real buffer."""

    def __init__(self, tmp: Path, *, enabled: bool = True) -> None:
        urls = ["http://replica-0", "http://replica-1"]
        self.cfg = HourglassConfig(
            state_dir=str(tmp / "state"),
            registry={"tracking_uri": "http://mlflow.invalid", "embedded": False},
            buffer={"root": str(tmp / "buffer"), "dead_letter_root": str(tmp / "dlq")},
            serving={
                "replicas": urls,
                "staging_dir": str(tmp / "staging"),
                "drain_s": 0.0,
                "embedded": False,
                "base_served_name": BASE,
                "canary": {"enabled": enabled, "fraction": 0.5, "min_feedback": 20, "margin": 0.1},
            },
        )
        self.reg = FakeRegistry()
        self.reg.add_versions(MODEL, 3)
        self.replicas = [FakeReplica(url) for url in urls]
        self.ctrl = ServingController(
            self.cfg, base_fingerprint="fp-test", client=self.reg, replicas=self.replicas, stage=FakeStager()
        )
        self.monitor = CanaryMonitor(self.cfg, models=[MODEL], client=self.reg)  # type: ignore[arg-type]

    def reconcile(self) -> dict:
        return self.ctrl.reconcile_once()[MODEL]

    def route(self) -> Route | None:
        return read_routes(self.ctrl.state_dir).get(MODEL)

    def resolver(self) -> RouteResolver:
        return RouteResolver(self.ctrl.state_dir, MODEL, BASE, ttl_s=0.0)

    def alias(self, name: str) -> str | None:
        return self.reg.alias(MODEL, name)

    def base_untouched(self) -> bool:
        return all(BASE not in r.ops("unload") and "base" not in r.ops("unload") for r in self.replicas)

    def feedback(self, version: str | None, ups: int, downs: int) -> None:
        """Traces answered by ``version`` (None: the base) with inline thumbs, written as ingestion does."""
        now = datetime.now(timezone.utc)
        events = [
            (
                TraceEvent(
                    trace_id=uuid.uuid4().hex,
                    ts=now,
                    model=MODEL,
                    adapter_version=version,
                    prompt="hi",
                    completion="ok",
                    thumbs="up" if i < ups else "down",
                ),
                Coordinates("traces", 0, i),
            )
            for i in range(ups + downs)
        ]
        RewardBuffer(self.cfg.buffer).append(events, [])

    def first_canary(self) -> None:
        """The round's winner v1 of a model without a champion: on canary against the base, routed."""
        out = state.promote_or_challenge(self.cfg, MODEL, "1", client=self.reg, reason="round r1")  # type: ignore[arg-type]
        assert (out["action"], out["control"]) == ("challenger", "base"), out
        self.reconcile()


@pytest.fixture
def stack(tmp_path: Path) -> Stack:
    return Stack(tmp_path)


def test_the_first_winner_becomes_challenger_not_champion(stack: Stack) -> None:
    out = state.promote_or_challenge(stack.cfg, MODEL, "1", client=stack.reg, reason="round r1")  # type: ignore[arg-type]

    assert out == {"model": MODEL, "version": "1", "action": "challenger", "reason": "round r1", "control": "base"}
    assert stack.alias("challenger") == "1" and stack.alias("champion") is None
    assert state.describe([out]) == "hourglass v1 on canary against the base"
    again = state.promote_or_challenge(stack.cfg, MODEL, "1", client=stack.reg)  # type: ignore[arg-type]
    assert (again["action"], again["control"]) == ("challenger", "base")  # a resumed round: the same canary
    waiting = state.promote_or_challenge(stack.cfg, MODEL, "2", client=stack.reg)  # type: ignore[arg-type]
    assert waiting["action"] == "not_started" and stack.alias("challenger") == "1"


def test_with_the_canary_off_the_first_winner_is_champion_at_once(tmp_path: Path) -> None:
    off = Stack(tmp_path, enabled=False)
    out = state.promote_or_challenge(off.cfg, MODEL, "1", client=off.reg)  # type: ignore[arg-type]

    assert (out["action"], out["reason"]) == ("promoted", "canary disabled")
    assert off.alias("champion") == "1" and off.alias("challenger") is None


def test_the_route_splits_the_base_and_the_challenger(stack: Stack) -> None:
    stack.first_canary()
    st = stack.reconcile()  # a steady pass changes nothing

    route = stack.route()
    assert route == Route(BASE, None, route.updated_at, f"{MODEL}-v1", "1", 0.5)
    assert st["challenger"] == {"version": "1", "served_name": f"{MODEL}-v1", "fraction": 0.5}
    assert st["desired"] is None and st["serving"] is None
    assert all(r.loaded == {f"{MODEL}-v1"} and r.ops("probe")[-1] == f"{MODEL}-v1" for r in stack.replicas)
    sides = {stack.resolver().route(MODEL, f"user-{i}") for i in range(200)}
    assert sides == {(BASE, None, False), (f"{MODEL}-v1", "1", True)}  # the base keeps the other users


@pytest.mark.parametrize("source", ["file", "kafka"])
def test_the_base_route_travels_and_old_records_still_load(stack: Stack, source: str) -> None:
    stack.first_canary()
    published = {MODEL: json.loads(json.dumps(stack.route().__dict__))}  # what the routes topic carries
    if source == "kafka":
        route = RouteResolver(None, MODEL, BASE, ttl_s=0.0, source=lambda: published).route(MODEL, "user-3")
    else:
        route = stack.resolver().route(MODEL, "user-3")
    assert route.version in (None, "1") and route.canary is (route.version == "1")

    old = {"served_name": f"{MODEL}-v2", "version": "2", "updated_at": "2026-01-01T00:00:00+00:00"}
    assert routes_from_dicts({MODEL: old, "junk": "not an object"}) == {
        MODEL: Route(f"{MODEL}-v2", "2", "2026-01-01T00:00:00+00:00")
    }
    (Path(stack.ctrl.state_dir) / "routes.json").write_text(json.dumps({MODEL: old}))
    assert stack.route() == Route(f"{MODEL}-v2", "2", "2026-01-01T00:00:00+00:00", None, None, 0.0)


def _gauge(name: str, version: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"served_model": MODEL, "version": version})


def test_users_reject_the_challenger_so_it_is_aborted_and_the_base_serves_on(stack: Stack) -> None:
    stack.first_canary()
    view = stack.monitor.check_once()[MODEL]["canary"]
    assert view["decision"] == "continue" and view["control"] == "base" and view["champion_version"] is None
    assert state.TAG_STARTED in stack.reg.tags(MODEL, "1")

    stack.feedback("1", ups=2, downs=18)
    stack.feedback(None, ups=16, downs=4)  # the base's answers (adapter_version null)
    view = stack.monitor.check_once()[MODEL]["last_canary"]

    assert view["decision"] == "abort" and view["upper"] < 0, view
    assert (view["challenger"]["n"], view["champion"]["n"], view["control"]) == (20, 20, "base")
    assert "vs base" in view["reason"]
    assert _gauge("hourglass_canary_feedback_count", "base") == 20 and _gauge("hourglass_canary_feedback_rate", "base")
    assert stack.alias("challenger") is None and stack.alias("champion") is None
    result = json.loads(stack.reg.tags(MODEL, "1")[state.TAG_RESULT])
    assert result["decision"] == "abort" and "worse" in result["reason"] and result["evidence"]["control"] == "base"

    stack.reconcile()
    stack.reconcile()  # the drained copy goes on the pass after the route lost it
    assert stack.route() is None  # no route: the gateway serves the base, as before the canary
    assert stack.resolver().route(MODEL, "user-1") == (BASE, None, None)
    assert all(r.loaded == set() for r in stack.replicas) and stack.base_untouched()


def test_users_like_the_challenger_so_it_becomes_the_first_champion(stack: Stack) -> None:
    stack.first_canary()
    stack.monitor.check_once()
    stack.feedback("1", ups=18, downs=4)
    stack.feedback(None, ups=6, downs=16)

    view = stack.monitor.check_once()[MODEL]["last_canary"]

    assert view["decision"] == "promote" and view["lower"] > -0.1, view
    assert stack.alias("champion") == "1" and stack.alias("challenger") is None
    tags = stack.reg.tags(MODEL, "1")
    assert json.loads(tags[state.TAG_RESULT])["decision"] == "promote"
    assert state.TAG_GUARD not in tags  # no earlier champion a guard could roll back to
    st = stack.reconcile()
    route = stack.route()
    assert (route.served_name, route.version, route.challenger_served_name) == (f"{MODEL}-v1", "1", None)
    assert st["serving"] == "1" and stack.resolver().route(MODEL, "user-1") == (f"{MODEL}-v1", "1", None)
    stack.reconcile()
    assert all(r.loaded == {f"{MODEL}-v1"} for r in stack.replicas) and stack.base_untouched()


def test_a_challenger_that_cannot_be_served_leaves_the_base_serving(stack: Stack) -> None:
    state.promote_or_challenge(stack.cfg, MODEL, "1", client=stack.reg)  # type: ignore[arg-type]
    stack.replicas[0].broken.add(f"{MODEL}-v1")

    st = stack.reconcile()

    assert stack.route() is None and stack.alias("challenger") is None and stack.alias("champion") is None
    assert "non-finite" in stack.reg.tags(MODEL, "1")[TAG_SERVE_ERROR]
    assert st["challenger"] is None and st["last_error"].startswith("challenger v1: ")
    assert stack.base_untouched()


@pytest.mark.parametrize("decision", ["promote", "abort"])
def test_the_operator_ends_a_canary_against_the_base_with_a_reason(stack: Stack, decision: str) -> None:
    stack.first_canary()

    out = end_canary(stack.cfg, MODEL, decision, who="cli", monitor=stack.monitor, note="checked by hand")

    assert out["version"] == "1" and out["decision"] == decision
    result = json.loads(stack.reg.tags(MODEL, "1")[state.TAG_RESULT])
    assert result["reason"] == f"{decision} by cli: checked by hand" and result["evidence"]["control"] == "base"
    assert stack.alias("champion") == ("1" if decision == "promote" else None)
    stack.reconcile()
    assert (stack.route() or Route(BASE, None, "")).version == ("1" if decision == "promote" else None)


def test_rollback_without_a_champion_says_what_serves_and_changes_nothing(stack: Stack) -> None:
    stack.first_canary()

    with pytest.raises(RegistryError) as err:
        aliases.rollback(stack.cfg, MODEL, client=stack.reg)  # type: ignore[arg-type]

    message = str(err.value)
    assert "no champion: the base model serves it" in message and "v1 is on canary" in message
    assert "hourglass canary abort" in message and "nothing was changed" in message
    assert stack.alias("challenger") == "1" and stack.alias("champion") is None

    state.promote_challenger(stack.cfg, MODEL, client=stack.reg)  # type: ignore[arg-type]
    with pytest.raises(RegistryError, match="no earlier champion.*base model is not a registered version"):
        aliases.rollback(stack.cfg, MODEL, client=stack.reg)  # type: ignore[arg-type]
    assert stack.alias("champion") == "1"


def test_a_champion_promoted_by_hand_during_a_canary_against_the_base_takes_the_base_side(stack: Stack) -> None:
    stack.first_canary()
    aliases.promote(stack.cfg, MODEL, "2", client=stack.reg, reason="operator")  # type: ignore[arg-type]

    stack.reconcile()
    stack.reconcile()

    route = stack.route()
    assert (route.served_name, route.version, route.challenger_version) == (f"{MODEL}-v2", "2", "1")
    assert stack.monitor.check_canary(MODEL, act=False)["control"] == "2"
    assert all(r.loaded == {f"{MODEL}-v1", f"{MODEL}-v2"} for r in stack.replicas) and stack.base_untouched()
