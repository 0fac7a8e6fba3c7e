"""Serving controller: make every vLLM replica serve each model's ``@champion``.

Desired state: the ``@champion`` alias of each served model in MLflow.
Actual state: each replica's ``GET /v1/models`` and the routes file.
:meth:`ServingController.reconcile_once` closes the gap; :meth:`start` runs it
every ``serving.reconcile_interval_s`` on a thread (and at once on
:meth:`trigger`). It repairs: an alias moved by anyone (CLI, API, MLflow UI),
a replica restarted (runtime adapters are lost), a replica added.

A hot-load, in order:
1. stage the version (:mod:`pipeline.serving.staging`: download, checksums,
   safetensors only, base fingerprint, rank, safe paths);
2. load it under ``<model>-v<version>`` on every reachable replica (never
   reloaded in place under an old name): by path, or, with
   ``serving.adapter_share_uri``, published to the shared adapter store from
   which each replica's resolver plugin fetches it (:mod:`pipeline.serving.lora_resolver`);
3. probe a completion through that name on each replica; only then it counts;
4. flip the route (``<state_dir>/routes.json``, written atomically with
   :func:`connectors.gateway.routes.write_route`; a gateway on the same host
   reads it there; with ``serving.routes_source = "kafka"`` the pass also
   publishes it to the compacted ``kafka.routes_topic`` that every gateway
   follows, :mod:`connectors.gateway.route_feed`);
5. unload the replaced version after ``serving.drain_s`` (and, with the
   topic, only once the broker acknowledged the new route).

A version on canary (``@challenger``) goes through the same steps beside the
champion (:mod:`pipeline.serving.challenger`); the route then also names it
and the share of traffic it gets. A model with no ``@champion`` yet has the
base model as the other side: its route names the base (version None) until
the canary ends.

If 1–3 fail for the adapter (staging refuses it, a replica answers the load
or probe with a 4xx or an invalid completion, or a healthy replica cannot load
it twice in a row), the previous champion keeps serving, the loaded copies are
unloaded, the version is tagged ``hourglass.serve_error`` with the reason, and
``@champion`` moves back to what is served. It is not retried until someone
promotes it again.

A replica problem (no answer, timeout, a 5xx from an unhealthy replica) is
transient: nothing is tagged, the alias stays, the error is counted in
``hourglass_serve_transient_errors_total{replica}`` and shown in the status,
and the next pass tries again.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

from mlflow.tracking import MlflowClient
from prometheus_client import Counter, Histogram

from connectors.errors import ConnectorError
from connectors.gateway.route_feed import RoutePublisher
from connectors.gateway.routes import Route, RouteRecordError, read_routes, write_route
from connectors.kafka_admin import ensure_routes_topic
from pipeline.registry.aliases import TAG_PROMOTED_BY, TAG_SERVE_ERROR, champion_version, revert_failed
from pipeline.config import HourglassConfig
from pipeline.registry.models import make_client
from pipeline.serving.challenger import reconcile_challenger
from pipeline.serving.common import AdapterFailure as _AdapterFailure
from pipeline.serving.common import ModelStatus
from pipeline.serving.common import utc_now as _now
from pipeline.serving.replica import Replica, ReplicaControl, ReplicaRefusedError, ReplicaUnreachableError
from pipeline.serving.staging import (
    StagedAdapter,
    StagingError,
    base_module_names,
    served_name,
    stage_options,
    stage_version,
)
from trainer.adapters.share import AdapterShareError, publish
from trainer.adapters.share import remove as share_remove

log = logging.getLogger(__name__)

HOTLOAD_S = Histogram("hourglass_serve_hotload_seconds", "Stage + load + probe time of a new version, seconds.")
TRANSIENT = Counter(
    "hourglass_serve_transient_errors",
    "Replica problems (no answer, 5xx) met while loading or probing; retried.",
    ["replica"],
)


# --- controller --------------------------------------------------------------------


Stager = Callable[..., StagedAdapter]
"""The staging step: called like :func:`pipeline.serving.staging.stage_version` (the real one); returns a
:class:`StagedAdapter`, raises :class:`StagingError` for a version that must not be loaded."""


class ServingController:
    """Reconciles vLLM replicas to the ``@champion`` alias of each served model.

    Args:
        cfg: the whole config (``registry``, ``serving``, ``model``, ``state_dir``).
        models: public model names to serve; default ``[serving.model_name]``.
        base_fingerprint: the served base's fingerprint; default computed from
            ``model.name`` with :func:`trainer.model.store.fingerprint_of`.
        client: an ``MlflowClient``; default :func:`pipeline.registry.models.make_client`.
        replicas: the replicas to reconcile (anything with :class:`~pipeline.serving.replica.ReplicaControl`'s
            methods); default one :class:`~pipeline.serving.replica.Replica` per ``serving.replicas`` URL.
        stage: the staging step; default :func:`pipeline.serving.staging.stage_version`.
    """

    def __init__(
        self,
        cfg: HourglassConfig,
        *,
        models: list[str] | None = None,
        base_fingerprint: str | None = None,
        client: MlflowClient | None = None,
        replicas: list[ReplicaControl] | None = None,
        stage: Stager | None = None,
    ) -> None:
        self.cfg = cfg
        self.models = models or [cfg.serving.model_name]
        if base_fingerprint is None:
            from trainer.model import store as model_store

            base_fingerprint = model_store.fingerprint_of(model_store.resolve(cfg.model.name, cfg.model.cache_dir))
        self.base_fingerprint = base_fingerprint
        self.base_modules = self._base_modules(cfg)
        self.client = client or make_client(cfg)
        self.state_dir = cfg.resolve(cfg.state_dir)
        self.staging_dir = cfg.staging_root()
        api_key = cfg.serving.api_key.get_secret_value() if cfg.serving.api_key is not None else None
        self.replicas: list[ReplicaControl] = (
            list(replicas) if replicas is not None else [Replica(url, api_key=api_key) for url in cfg.serving.replicas]
        )
        self._stage: Stager = stage or stage_version
        self._status = {m: ModelStatus(m) for m in self.models}
        self._draining: dict[str, float] = {}  # served name -> monotonic deadline for its unload
        self._failed: dict[tuple[str, str], str | None] = {}  # (model, version) -> promote tag when it failed
        self._route_publisher = RoutePublisher(cfg.kafka) if cfg.serving.routes_source == "kafka" else None
        self._published_routes: dict[str, dict] | None = None  # what the routes topic acknowledged last
        self._routes_file_error: str | None = None  # why the routes file did not parse, logged once
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _base_modules(cfg: HourglassConfig) -> frozenset[str] | None:
        """The base's LoRA-targetable module names (staging checks target_modules against them), once."""
        from trainer.model import store as model_store

        try:
            return base_module_names(model_store.resolve(cfg.model.name, cfg.model.cache_dir))
        except Exception as err:  # no local copy of the base: staging checks the list's shape only
            log.warning(
                "base model %s not readable here (%s); adapter target_modules are not checked by name",
                cfg.model.name,
                err,
            )
            return None

    # -- public -------------------------------------------------------------------

    def status(self) -> dict[str, dict]:
        """``{model: ModelStatus as dict}``: desired and served version, last error, replicas."""
        return {m: asdict(s) for m, s in self._status.items()}

    def reconcile_once(self) -> dict[str, dict]:
        """One pass over every served model; returns :meth:`status`. Never raises for
        MLflow or replica outages (they are reported in the status). While the routes file does not
        parse (a hand-edit), the pass changes nothing: no load, route, publish or unload."""
        with self._lock:
            if self._routes_now() is None:
                return self.status()
            for model in self.models:
                try:
                    self._reconcile_model(model)
                    reconcile_challenger(self, model)  # the canary's @challenger beside the champion
                except RouteRecordError:  # the routes file broke during the pass: stop; the read below says why
                    break
                except Exception as err:  # MLflow down or unexpected: report, keep serving
                    log.warning("reconcile %s: %s", model, err)
                    st = self._status[model]
                    st.last_error, st.updated_at = f"{type(err).__name__}: {err}", _now()
            routes = self._routes_now()  # as the pass left them: one read for the publish and the unloads
            if routes is not None and self._publish_routes(routes):  # gateways first, then the old version goes
                self._unload_drained(routes)
        return self.status()

    def _routes_now(self) -> dict[str, Route] | None:
        """The routes file's routes; None while it exists and does not parse (logged once, in every model's
        ``last_error``): a route written over it would drop the other models' routes, and the gateways, which
        keep the routes they read last, may still send users to any version."""
        try:
            routes = read_routes(self.state_dir, strict=True)
        except RouteRecordError as err:
            reason = f"{err}: nothing is loaded, routed, published or unloaded until it parses (fix or remove it)"
            if reason != self._routes_file_error:  # once, not on every pass
                log.warning("%s", reason)
                self._routes_file_error = reason
            for st in self._status.values():
                st.last_error, st.last_error_version, st.updated_at = reason, None, _now()
            return None
        if self._routes_file_error is not None:
            log.info("routes file parses again")
            for st in self._status.values():
                if st.last_error == self._routes_file_error:
                    st.last_error = None
            self._routes_file_error = None
        return routes

    def _publish_routes(self, routes: dict[str, Route]) -> bool:
        """With ``serving.routes_source = "kafka"``: publish the routes that changed since the last
        acknowledged publish (all of them on the first pass) to ``kafka.routes_topic``. Returns False while
        a change is not acknowledged (the next pass retries; drained versions stay loaded meanwhile)."""
        if self._route_publisher is None:
            return True
        current = {m: asdict(r) for m, r in routes.items()}
        if current == self._published_routes:
            return True
        before = self._published_routes or {}
        changed: dict[str, dict | None] = {m: r for m, r in current.items() if before.get(m) != r}
        changed.update({m: None for m in before if m not in current})
        try:
            if self._published_routes is None:
                ensure_routes_topic(self.cfg.kafka)
            self._route_publisher.publish(changed)
        except ConnectorError as err:
            log.warning("routes not published (gateways keep the previous ones; retried next pass): %s", err)
            for model in self.models:
                self._status[model].last_transient_error = f"{_now()} {err}"
            return False
        self._published_routes = current
        return True

    def trigger(self) -> None:
        """Wake the loop now (e.g. right after a promote through the API)."""
        self._wake.set()

    def start(self) -> None:
        """Run the reconcile loop on a daemon thread until :meth:`stop`."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="hourglass-reconcile", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop and wait for the pass in progress to end."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def run(self, stop: threading.Event | None = None) -> None:
        """The loop body: reconcile, then sleep until the interval or the next unload is due.

        Runs until :meth:`stop`, or until ``stop`` is set (wake it with :meth:`trigger`).
        """
        while not self._stop.is_set() and not (stop is not None and stop.is_set()):
            self.reconcile_once()
            wait_s = self.cfg.serving.reconcile_interval_s
            if self._draining:
                wait_s = min(wait_s, max(0.05, min(self._draining.values()) - time.monotonic()))
            self._wake.wait(wait_s)
            self._wake.clear()

    def close(self) -> None:
        self.stop()
        for replica in self.replicas:
            replica.close()
        if self._route_publisher is not None:
            self._route_publisher.close()

    # -- one model ----------------------------------------------------------------

    def _observe(self, st: ModelStatus) -> dict[ReplicaControl, set[str]]:
        seen: dict[ReplicaControl, set[str]] = {}
        for replica in self.replicas:
            try:
                names = replica.models()
            except (ReplicaUnreachableError, ReplicaRefusedError) as err:
                st.replicas[replica.url] = f"unreachable: {err}"
                continue
            seen[replica] = set(names)
            st.replicas[replica.url] = sorted(names)
        return seen

    def _reconcile_model(self, model: str) -> None:
        st = self._status[model]
        route = read_routes(self.state_dir, strict=True).get(model)
        st.serving = route.version if route else None
        desired = champion_version(self.client, model, self.cfg.registry.champion_alias)
        st.desired, st.updated_at = desired, _now()
        seen = self._observe(st)
        if desired is None or not seen:
            return
        name = served_name(model, desired)
        if desired != st.serving:
            mv = self.client.get_model_version(model, desired)
            promoted = mv.tags.get(TAG_PROMOTED_BY)
            if (
                TAG_SERVE_ERROR in mv.tags
                or (model, desired) in self._failed
                and self._failed[(model, desired)] == promoted
            ):
                reason = mv.tags.get(TAG_SERVE_ERROR, "failed before")
                st.last_error = f"not retrying v{desired} (promote it again to retry): {reason}"
                st.last_error_version = desired
                revert_failed(self.client, self.cfg, model, desired, reason, st.serving)
                return
            self._roll_out(model, desired, seen, promoted, mv)
        else:
            missing = [r for r, names in seen.items() if name not in names]
            if missing:  # a replica restarted or was added
                try:
                    loaded = self._load_on(model, desired, missing)
                except _AdapterFailure as err:
                    st.last_error, st.last_error_version = str(err), desired
                else:  # an earlier reload of it failed: this one reached every replica that lacked it
                    if len(loaded) == len(missing) and st.last_error_version == desired:
                        st.last_error, st.last_error_version = None, None
        self._unload_stale(model, seen)

    def _load_on(self, model: str, version: str, replicas: list[ReplicaControl], mv=None) -> list[ReplicaControl]:
        """Stage, load and probe on ``replicas``; returns those that now serve it.

        With ``serving.adapter_share_uri`` the staged folder is published to the
        share and the probe itself makes each replica fetch and load it; otherwise
        each replica loads the staged folder by path.

        Raises:
            _AdapterFailure: staging refused it, or a replica refused the load or probe.
        """
        try:
            staged = self._stage(
                self.client,
                model,
                version,
                self.staging_dir,
                base_fingerprint=self.base_fingerprint,
                base_modules=self.base_modules,
                model_version=mv,
                **stage_options(self.cfg),
            )
        except StagingError as err:
            raise _AdapterFailure(f"staging refused {model} v{version}: {err}") from err
        share = self.cfg.serving.adapter_share_uri
        if share is not None and replicas:
            try:
                publish(staged.path, share, staged.served_name)
            except AdapterShareError as err:  # the store's problem, not the adapter's: retried on the next pass
                raise ReplicaUnreachableError(
                    f"cannot publish {staged.served_name} to serving.adapter_share_uri: {err}"
                ) from err
        done: list[ReplicaControl] = []
        for replica in replicas:
            try:
                if share is None:
                    replica.load(staged.served_name, str(staged.path))
                # With a share, the probe through the new name makes the replica fetch it (pipeline.serving.lora_resolver).
                done.append(replica)
                try:
                    replica.probe(staged.served_name)
                except ReplicaRefusedError as err:
                    if share is None or "does not exist" not in str(err):
                        raise
                    # Published, yet the replica could not fetch it (its access to the share, or no resolver
                    # plugin there): the replica's problem, retried next pass. A fetched adapter that vLLM cannot
                    # load answers 400 instead, which stays the adapter's fault.
                    raise ReplicaUnreachableError(
                        f"{err} (published to {share}; the replica's Hourglass LoRA resolver plugin did not fetch it: "
                        "check its HOURGLASS_ADAPTER_SHARE and its access to the share)"
                    ) from err
            except ReplicaUnreachableError as err:  # the replica's problem, not the adapter's
                self._transient(model, replica, err)
                log.warning("%s; will load %s there on a later pass", err, staged.served_name)
                if replica in done:
                    done.remove(replica)
            except ReplicaRefusedError as err:
                for loaded in done:
                    self._try_unload(loaded, staged.served_name)
                raise _AdapterFailure(str(err)) from err
        return done

    def _roll_out(
        self, model: str, version: str, seen: dict[ReplicaControl, set[str]], promoted: str | None, mv
    ) -> None:
        st = self._status[model]
        started = time.monotonic()
        name = served_name(model, version)
        try:
            need = [r for r, names in seen.items() if name not in names]
            ready = self._load_on(model, version, need, mv)
            for replica in [r for r in seen if r not in need]:
                try:
                    replica.probe(name)  # already there (e.g. loaded by a previous pass): prove it
                except ReplicaUnreachableError as err:
                    self._transient(model, replica, err)
                    continue
                ready.append(replica)
        except (_AdapterFailure, ReplicaRefusedError) as err:
            reason = str(err)
            log.error("not serving %s v%s: %s", model, version, reason)
            st.last_error, st.last_error_version = reason, version
            self._failed[(model, version)] = promoted
            revert_failed(self.client, self.cfg, model, version, reason, st.serving)
            return
        if not ready:
            return  # every replica went away or failed transiently: try again on the next pass
        previous = read_routes(self.state_dir, strict=True).get(model)
        write_route(self.state_dir, model, Route(served_name=name, version=version, updated_at=_now()))
        elapsed = time.monotonic() - started
        HOTLOAD_S.observe(elapsed)
        st.serving, st.last_hotload_s = version, elapsed
        if st.last_error_version == version or st.last_error_version is None:
            st.last_error, st.last_error_version = None, None
        if previous is not None and previous.version is not None and previous.served_name != name:
            # (a route with no version is the base, routed during a first canary: never unloaded)
            self._draining[previous.served_name] = time.monotonic() + self.cfg.serving.drain_s
        log.info("serving %s v%s as %s (%.2fs)", model, version, name, elapsed)

    def _transient(self, model: str, replica: ReplicaControl, err: Exception) -> None:
        st = self._status[model]
        st.transient_errors += 1
        st.last_transient_error = f"{_now()} {err}"
        TRANSIENT.labels(replica.url).inc()

    # -- unloads ------------------------------------------------------------------

    def _try_unload(self, replica: ReplicaControl, name: str) -> bool:
        try:
            replica.unload(name)
            return True
        except (ReplicaUnreachableError, ReplicaRefusedError) as err:
            log.warning("%s", err)
            return False

    def _unload_drained(self, routes: dict[str, Route]) -> None:
        now = time.monotonic()
        routed = {n for r in routes.values() for n in (r.served_name, r.challenger_served_name) if n}
        for name, deadline in list(self._draining.items()):
            if deadline > now:
                continue
            if name not in routed:
                for replica in self.replicas:
                    self._try_unload(replica, name)
                if self.cfg.serving.adapter_share_uri is not None:
                    try:
                        share_remove(self.cfg.serving.adapter_share_uri, name)
                    except AdapterShareError as err:  # the store's problem: removed on a later pass
                        log.warning("adapter share: %s not removed yet: %s", name, err)
                        continue
            del self._draining[name]

    def _unload_stale(self, model: str, seen: dict[ReplicaControl, set[str]]) -> None:
        """Unload ``<model>-v<N>`` names that are neither routed, draining, nor desired."""
        st = self._status[model]
        keep = {served_name(model, v) for v in (st.serving, st.desired) if v is not None} | set(self._draining)
        keep |= {  # the canary's; a routes file that does not parse raises: it may route to any version
            n for r in read_routes(self.state_dir, strict=True).values() for n in (r.challenger_served_name,) if n
        }
        pattern = re.compile(rf"^{re.escape(model)}-v[0-9]+$")
        for replica, names in seen.items():
            for name in names:
                if pattern.match(name) and name not in keep:
                    self._try_unload(replica, name)
