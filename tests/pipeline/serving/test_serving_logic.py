"""Reconcile decisions of :class:`pipeline.serving.controller.ServingController` with fake replicas, a fake registry
and a fake staging step: what gets staged, loaded, probed, routed and unloaded, and what a replica
problem (transient) or an adapter fault (refused) does to the alias and the route.

The same behaviour is proven on real MLflow + vLLM in ``test_serving.py``, ``test_serving_hiccup.py``,
``test_serving_restart.py`` and ``test_canary.py``; these run in milliseconds. Which replica errors are
transient and which refuse a version, case by case: ``test_serving_transient.py`` (same fakes).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.registry import aliases
from pipeline.registry.aliases import TAG_SERVE_ERROR
from pipeline.canary import state
from pipeline.config import HourglassConfig
from pipeline.serving.replica import ReplicaRefusedError, ReplicaServerError
from connectors.gateway.routes import read_routes
from pipeline.serving.controller import ServingController
from tests.pipeline.registry_fakes import FakeRegistry, FakeReplica, FakeStager

MODEL = "hourglass"


class Stack:
    """A controller over two fake replicas, a fake registry with five versions of ``MODEL``, a fake stager."""

    def __init__(self, tmp: Path, *, drain_s: float = 0.0, replicas: int = 2) -> None:
        urls = [f"http://replica-{i}" for i in range(replicas)]
        self.cfg = HourglassConfig(
            state_dir=str(tmp / "state"),
            registry={"tracking_uri": "http://mlflow.invalid", "embedded": False},
            serving={"replicas": urls, "staging_dir": str(tmp / "staging"), "drain_s": drain_s, "embedded": False},
        )
        self.reg = FakeRegistry()
        self.reg.add_versions(MODEL, 5)
        self.replicas = [FakeReplica(url) for url in urls]
        self.stage = FakeStager()
        self.ctrl = ServingController(
            self.cfg, base_fingerprint="fp-test", client=self.reg, replicas=self.replicas, stage=self.stage
        )

    def promote(self, version: str, reason: str = "test") -> None:
        aliases.promote(self.cfg, MODEL, version, client=self.reg, reason=reason)

    def serve_with_challenger(self, champion: str, challenger: str) -> None:
        """``champion`` served, then ``challenger`` put on canary and routed beside it."""
        self.promote(champion)
        self.reconcile()
        state.start_challenger(self.cfg, MODEL, challenger, client=self.reg)
        self.reconcile()

    def reconcile(self) -> dict:
        return self.ctrl.reconcile_once()[MODEL]

    def route(self):
        return read_routes(self.ctrl.state_dir).get(MODEL)

    def champion(self) -> str | None:
        return self.reg.alias(MODEL, "champion")

    def forget_calls(self) -> None:
        for replica in self.replicas:
            replica.calls.clear()
        self.stage.calls.clear()


@pytest.fixture
def stack(tmp_path: Path) -> Stack:
    return Stack(tmp_path)


def test_nothing_to_serve_without_a_champion(stack: Stack) -> None:
    st = stack.reconcile()

    assert st["desired"] is None and st["serving"] is None
    assert stack.route() is None
    assert stack.stage.calls == []
    assert st["replicas"] == {"http://replica-0": ["base"], "http://replica-1": ["base"]}


def test_a_new_champion_is_staged_loaded_probed_then_routed(stack: Stack) -> None:
    stack.promote("1")

    st = stack.reconcile()

    assert stack.stage.calls == [(MODEL, "1")]
    for replica in stack.replicas:
        assert replica.calls[1:] == [("load", "hourglass-v1"), ("probe", "hourglass-v1")]  # after the models() look
    route = stack.route()
    assert (route.served_name, route.version, route.challenger_served_name) == ("hourglass-v1", "1", None)
    assert st["serving"] == "1" and st["desired"] == "1" and st["last_error"] is None
    assert st["last_hotload_s"] is not None


def test_a_steady_pass_loads_nothing(stack: Stack) -> None:
    stack.promote("1")
    stack.reconcile()
    stack.forget_calls()

    stack.reconcile()

    assert stack.stage.calls == []
    assert all(r.calls == [("models", "")] for r in stack.replicas)


def test_a_promotion_flips_the_route_and_unloads_the_old_version_after_the_drain(stack: Stack) -> None:
    stack.promote("1")
    stack.reconcile()

    stack.promote("2")
    st = stack.reconcile()

    assert stack.route().served_name == "hourglass-v2"
    assert st["serving"] == "2"
    for replica in stack.replicas:
        assert replica.loaded == {"hourglass-v2"}  # drain_s = 0: v1 went in the same pass
        assert replica.ops("unload") == ["hourglass-v1"]


def test_the_replaced_version_stays_loaded_while_it_drains(tmp_path: Path) -> None:
    stack = Stack(tmp_path, drain_s=3600)
    stack.promote("1")
    stack.reconcile()
    stack.promote("2")

    stack.reconcile()
    stack.reconcile()

    assert stack.route().served_name == "hourglass-v2"
    assert all(r.loaded == {"hourglass-v1", "hourglass-v2"} for r in stack.replicas)
    assert all(r.ops("unload") == [] for r in stack.replicas)
    assert "hourglass-v1" in stack.ctrl._draining


def test_a_restarted_replica_gets_the_champion_back_and_the_route_stays(stack: Stack) -> None:
    stack.promote("1")
    stack.reconcile()
    before = stack.route()
    stack.replicas[1].restart()  # runtime adapters are lost on restart
    stack.forget_calls()

    stack.reconcile()

    assert stack.replicas[1].ops("load") == ["hourglass-v1"]
    assert stack.replicas[0].ops("load") == []
    assert stack.replicas[1].loaded == {"hourglass-v1"}
    assert stack.route() == before


def test_an_unreachable_replica_is_skipped_then_caught_up(stack: Stack) -> None:
    stack.replicas[1].down = True
    stack.promote("1")

    st = stack.reconcile()

    assert stack.route().served_name == "hourglass-v1"  # one replica ready is enough to route
    assert st["replicas"]["http://replica-1"].startswith("unreachable: ")
    assert stack.replicas[1].loaded == set()

    stack.replicas[1].down = False
    stack.reconcile()

    assert stack.replicas[1].loaded == {"hourglass-v1"}
    st = stack.reconcile()  # the status lists what each replica served at the start of the pass
    assert st["replicas"]["http://replica-1"] == ["base", "hourglass-v1"]


def test_a_transient_failure_on_one_replica_still_rolls_out_on_the_others(stack: Stack) -> None:
    stack.promote("1")
    stack.reconcile()
    stack.promote("2")
    stack.replicas[1].fail("load", ReplicaServerError("HTTP 503", 503))

    st = stack.reconcile()

    assert stack.route().served_name == "hourglass-v2"
    assert stack.replicas[0].loaded == {"hourglass-v2"}
    assert "hourglass-v2" not in stack.replicas[1].loaded
    assert st["transient_errors"] == 1

    stack.reconcile()

    assert "hourglass-v2" in stack.replicas[1].loaded


@pytest.mark.parametrize("fault", ["staging", "load", "probe"])
def test_an_adapter_fault_refuses_the_version_and_the_champion_keeps_serving(stack: Stack, fault: str) -> None:
    stack.promote("1")
    stack.reconcile()
    stack.promote("2")
    if fault == "staging":
        stack.stage.refuse[(MODEL, "2")] = "checksum mismatch for 'adapter_model.safetensors'"
    elif fault == "load":
        stack.replicas[1].refuse["hourglass-v2"] = "adapter_config.json is invalid"
    else:
        stack.replicas[1].broken.add("hourglass-v2")

    st = stack.reconcile()

    route = stack.route()
    assert (route.served_name, route.version) == ("hourglass-v1", "1")
    assert stack.champion() == "1"  # the alias moved back to what is served
    assert aliases.history(stack.reg, MODEL) == ["1"]
    assert st["last_error_version"] == "2" and st["serving"] == "1"
    assert TAG_SERVE_ERROR in stack.reg.tags(MODEL, "2")
    for replica in stack.replicas:
        assert replica.loaded == {"hourglass-v1"}  # copies loaded before the refusal are unloaded
    if fault == "staging":
        assert all(r.ops("load") == ["hourglass-v1"] for r in stack.replicas)  # never reached a replica


def test_a_refused_version_is_not_retried_until_promoted_again(stack: Stack) -> None:
    stack.promote("1")
    stack.reconcile()
    stack.promote("2")
    stack.replicas[0].refuse["hourglass-v2"] = "bad adapter"
    stack.reconcile()
    stack.reg.set_registered_model_alias(MODEL, "champion", "2")  # moved back by hand: still tagged
    stack.forget_calls()

    st = stack.reconcile()

    assert stack.stage.calls == []
    assert stack.champion() == "1"
    assert st["last_error"].startswith("not retrying v2 (promote it again to retry)")

    del stack.replicas[0].refuse["hourglass-v2"]
    stack.promote("2", reason="operator retry")  # clears the serve error
    stack.reconcile()

    assert stack.route().served_name == "hourglass-v2"
    assert stack.champion() == "2"


def test_a_refused_first_champion_drops_the_alias(stack: Stack) -> None:
    stack.promote("1")
    stack.stage.refuse[(MODEL, "1")] = "trained on another base"

    st = stack.reconcile()

    assert stack.champion() is None
    assert stack.route() is None
    assert "trained on another base" in st["last_error"]


def test_an_unreachable_registry_is_reported_and_serving_goes_on(stack: Stack) -> None:
    stack.promote("1")
    stack.reconcile()
    stack.reg.down = True

    st = stack.reconcile()

    assert st["last_error"].startswith("MlflowException: ") and "connection refused" in st["last_error"]
    assert stack.route().served_name == "hourglass-v1"
    assert all(r.loaded == {"hourglass-v1"} for r in stack.replicas)


def test_stale_versions_are_unloaded_but_other_names_are_kept(stack: Stack) -> None:
    stack.promote("1")
    stack.replicas[0].loaded |= {"hourglass-v7", "other-v3", "hourglass-v2-extra"}

    stack.reconcile()

    assert stack.replicas[0].ops("unload") == ["hourglass-v7"]
    assert stack.replicas[0].loaded == {"hourglass-v1", "other-v3", "hourglass-v2-extra"}


# --- champion + challenger (the canary step of the same pass) -----------------------------------


def test_a_challenger_is_loaded_beside_the_champion_and_gets_its_share(stack: Stack) -> None:
    stack.serve_with_challenger("1", "2")

    st = stack.reconcile()

    route = stack.route()
    assert (route.served_name, route.challenger_served_name, route.challenger_version) == (
        "hourglass-v1",
        "hourglass-v2",
        "2",
    )
    assert route.fraction == stack.cfg.serving.canary.fraction
    assert st["challenger"] == {"version": "2", "served_name": "hourglass-v2", "fraction": route.fraction}
    assert all(r.loaded == {"hourglass-v1", "hourglass-v2"} for r in stack.replicas)
    assert all(r.ops("probe")[-1] == "hourglass-v2" for r in stack.replicas)


def test_a_restarted_replica_gets_both_champion_and_challenger_back(stack: Stack) -> None:
    stack.serve_with_challenger("1", "2")
    stack.replicas[0].restart()

    stack.reconcile()

    assert stack.replicas[0].loaded == {"hourglass-v1", "hourglass-v2"}
    assert stack.route().challenger_version == "2"


def test_a_challenger_that_fails_its_probe_is_aborted_and_the_champion_keeps_all_traffic(stack: Stack) -> None:
    stack.promote("1")
    stack.reconcile()
    state.start_challenger(stack.cfg, MODEL, "2", client=stack.reg)
    stack.replicas[1].broken.add("hourglass-v2")

    st = stack.reconcile()

    route = stack.route()
    assert route.served_name == "hourglass-v1" and route.challenger_served_name is None
    assert state.challenger_version(stack.reg, stack.cfg, MODEL) is None
    assert stack.champion() == "1"
    tags = stack.reg.tags(MODEL, "2")
    assert "non-finite logprobs" in tags[TAG_SERVE_ERROR]
    assert '"decision": "abort"' in tags[state.TAG_RESULT]
    assert st["challenger"] is None and st["last_error"].startswith("challenger v2: ")
    assert all("hourglass-v2" not in r.loaded for r in stack.replicas)


@pytest.mark.parametrize("decision", ["abort", "promote"])
def test_a_finished_canary_leaves_the_route_and_its_loser_is_unloaded(stack: Stack, decision: str) -> None:
    stack.serve_with_challenger("1", "2")
    if decision == "abort":
        state.abort_challenger(stack.cfg, MODEL, client=stack.reg, reason="users preferred the champion")
    else:
        state.promote_challenger(stack.cfg, MODEL, client=stack.reg, reason="users preferred the challenger")

    stack.reconcile()
    stack.reconcile()  # the drained copy goes on the pass after the route lost it

    winner = "1" if decision == "abort" else "2"
    route = stack.route()
    assert (route.version, route.served_name) == (winner, f"hourglass-v{winner}")
    assert route.challenger_served_name is None and route.challenger_version is None and route.fraction == 0.0
    assert all(r.loaded == {f"hourglass-v{winner}"} for r in stack.replicas)
    assert stack.champion() == winner


def test_replica_refused_error_from_an_already_loaded_copy_refuses_the_version(stack: Stack) -> None:
    """A copy left loaded by an earlier pass is probed, not reloaded; a refused probe refuses the version."""
    stack.promote("1")
    stack.reconcile()
    for replica in stack.replicas:
        replica.loaded.add("hourglass-v2")
    stack.replicas[0].fail("probe", ReplicaRefusedError("HTTP 400: adapter produced no tokens"))
    stack.promote("2")

    stack.reconcile()

    assert stack.stage.calls == [(MODEL, "1"), (MODEL, "2")]
    assert stack.champion() == "1"
    assert "no tokens" in stack.reg.tags(MODEL, "2")[TAG_SERVE_ERROR]


def _break_routes(stack: Stack) -> tuple[Path, str]:
    """A hand-edit with one stray comma before the routes file's closing brace."""
    routes = Path(stack.ctrl.state_dir) / "routes.json"
    broken = routes.read_text().rstrip()[:-1] + ",}"
    routes.write_text(broken)
    return routes, broken


def test_a_routes_file_that_does_not_parse_is_not_overwritten_and_nothing_is_unloaded(stack: Stack) -> None:
    """A hand-edit with a stray comma: the controller once rewrote the file from nothing (dropping every other
    model's route) and unloaded the canary's challenger, which the gateways, keeping their last routes, still
    send users to."""
    stack.serve_with_challenger("1", "2")
    routes, broken = _break_routes(stack)
    stack.promote("3")  # a promotion while the file is broken (the canary of v2 ends with it)
    stack.forget_calls()

    st = stack.reconcile()
    stack.reconcile()

    assert routes.read_text() == broken  # not rewritten: the gateways keep serving what it said last
    assert all(r.ops("unload") == [] and r.ops("load") == [] for r in stack.replicas)
    assert all({"hourglass-v1", "hourglass-v2"} <= r.loaded for r in stack.replicas)
    assert "routes file" in st["last_error"] and "unreadable" in st["last_error"] and st["serving"] == "1"

    routes.unlink()  # fixed by hand (here: removed); the next pass routes the new champion
    st = stack.reconcile()
    assert stack.route().served_name == "hourglass-v3" and st["serving"] == "3" and st["last_error"] is None


def test_a_replica_that_fails_while_the_routes_file_does_not_parse_does_not_demote_the_champion(stack: Stack) -> None:
    """A broken file read as "nothing served": a restarted replica's refused reload then went down the new-version
    path, and the working champion lost its alias and was tagged as failed."""
    stack.promote("1")
    stack.reconcile()
    routes, broken = _break_routes(stack)
    stack.replicas[1].restart()
    stack.replicas[1].fail("load", ReplicaRefusedError("HTTP 400"))

    st = stack.reconcile()

    assert stack.champion() == "1" and TAG_SERVE_ERROR not in stack.reg.get_model_version(MODEL, "1").tags
    assert st["serving"] == "1" and "routes file" in st["last_error"]
    routes.write_text(broken.replace(",}", "}"))  # fixed: the replica gets the champion back, the error goes
    stack.reconcile()
    st = stack.reconcile()
    assert "hourglass-v1" in stack.replicas[1].loaded and st["last_error"] is None and stack.champion() == "1"


def test_a_routes_file_broken_right_after_its_parse_check_is_not_published_as_no_routes(
    stack: Stack, monkeypatch
) -> None:
    """The publish re-read the file after checking it: a file broken between the two reads was published as
    "no routes", a removal of every model on every gateway of the routes topic."""
    from pipeline.serving import controller as controller_module

    sent: list[dict] = []
    monkeypatch.setattr(controller_module, "ensure_routes_topic", lambda cfg: False)
    stack.ctrl._route_publisher = type("Publisher", (), {"publish": lambda self, changed: sent.append(changed)})()
    stack.promote("1")
    stack.reconcile()
    assert len(sent) == 1
    real = controller_module.read_routes

    def read_then_break(state_dir, refused=None, *, strict=False):
        out = real(state_dir, refused, strict=strict)
        if strict:  # an editor saves in place right after each parse check
            _break_routes(stack)
        return out

    monkeypatch.setattr(controller_module, "read_routes", read_then_break)
    monkeypatch.setattr(stack.ctrl, "_reconcile_model", lambda model: None)  # the pass's publish step alone
    monkeypatch.setattr(controller_module, "reconcile_challenger", lambda ctrl, model: None)
    stack.reconcile()
    stack.reconcile()
    assert len(sent) == 1 and sent[0]["hourglass"]["served_name"] == "hourglass-v1", sent  # no removal after it


def _break_after_the_passs_first_check(stack: Stack, *, repair_before_the_last: bool = False) -> None:
    """The routes file breaks right after the pass checked that it parses (an editor saving in place), and
    with ``repair_before_the_last`` is whole again before the pass's last read."""
    check, reads, saved = stack.ctrl._routes_now, [0], {}

    def routes_now():
        reads[0] += 1
        if reads[0] == 2 and repair_before_the_last:
            saved["path"].write_text(saved["good"])
        out = check()
        if reads[0] == 1:
            saved["path"] = Path(stack.ctrl.state_dir) / "routes.json"
            saved["good"] = saved["path"].read_text()
            _break_routes(stack)
        return out

    stack.ctrl._routes_now = routes_now  # type: ignore[method-assign]


def test_a_routes_file_that_breaks_during_a_pass_demotes_nothing_and_stages_nothing(stack: Stack) -> None:
    """Reads after the pass's check took a broken file as "nothing served": v1 was staged and probed again, and a
    restarted replica's refused reload took v1's @champion away."""
    stack.promote("1")
    stack.reconcile()
    stack.forget_calls()
    stack.replicas[1].restart()
    stack.replicas[1].fail("load", ReplicaRefusedError("HTTP 400"))
    _break_after_the_passs_first_check(stack)

    st = stack.reconcile()

    assert stack.champion() == "1" and TAG_SERVE_ERROR not in stack.reg.get_model_version(MODEL, "1").tags
    assert stack.stage.calls == [] and st["serving"] == "1" and "routes file" in st["last_error"]


def test_a_canary_against_the_base_is_not_aborted_by_a_routes_file_that_breaks_during_a_pass(stack: Stack) -> None:
    state.start_challenger(stack.cfg, MODEL, "2", client=stack.reg)
    stack.reconcile()
    assert stack.route().challenger_version == "2"
    stack.replicas[1].restart()
    stack.replicas[1].fail("load", ReplicaRefusedError("HTTP 400"))
    _break_after_the_passs_first_check(stack)

    stack.reconcile()

    assert state.challenger_version(stack.reg, stack.cfg, MODEL) == "2"


def test_a_routes_file_broken_and_repaired_within_a_pass_leaves_no_error_behind(stack: Stack) -> None:
    stack.promote("1")
    stack.reconcile()
    _break_after_the_passs_first_check(stack, repair_before_the_last=True)
    stack.reconcile()
    stack.ctrl._routes_now = type(stack.ctrl)._routes_now.__get__(stack.ctrl)  # type: ignore[method-assign]
    assert stack.reconcile()["last_error"] is None


def test_a_reload_error_stays_until_the_reload_reaches_the_replica(stack: Stack) -> None:
    stack.promote("1")
    stack.reconcile()
    stack.replicas[1].restart()
    stack.replicas[1].fail("load", ReplicaRefusedError("HTTP 400"))
    assert "HTTP 400" in stack.reconcile()["last_error"]
    stack.replicas[1].fail("load", ReplicaServerError("HTTP 503", 503))  # transient: not loaded, not cleared
    assert "HTTP 400" in stack.reconcile()["last_error"] and "hourglass-v1" not in stack.replicas[1].loaded
    assert stack.reconcile()["last_error"] is None and "hourglass-v1" in stack.replicas[1].loaded
