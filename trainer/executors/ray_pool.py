"""The trainer actors of the ``ray`` executor and their lifetime: connect, place, start, keep, warm.

A *pool* is one placement group (one bundle per actor, ``SPREAD``) and one
:class:`trainer.executors.ray_actor.TrainerActor` per bundle. Creating a pool does
not wait: the placement group is requested and the actors are submitted into
it at once, so their start-up (process, imports, base load) runs while the
caller does other work; :func:`wait_placed` and :func:`wait_started` wait for
them later, with a timeout, the cluster's free resources in the log, and a
cancel hook.

At most one pool per process is *kept* between rounds (``rl.ray.keep_actors``,
or :func:`warm`, which the service calls at its start and after a failed
round). A round takes the kept pool when it fits (same model, same bundle, at
least as many actors, every actor answers or is still starting); otherwise
the kept pool is killed and a new one is made. While a round holds the pool,
:func:`warm` does nothing, so a background warm-up never competes with a
round for the cluster's resources.
Upstream API: https://docs.ray.io/en/latest/ray-core/scheduling/placement-group.html
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from trainer.config import ModelConfig, RLConfig
from trainer.errors import ExecutorError, ExecutorUnavailableError, PlacementTimeoutError
from trainer.executors.ray_actor import TrainerActor
from trainer.types import PhaseBoundary, RoundPhase

log = logging.getLogger(__name__)

__all__ = ["Pool", "acquire", "actor_count", "connect", "release", "release_kept_actors", "warm"]

POLL_S = 1.0  # how often a wait checks its deadline and a cancel


def _probe(address: str, timeout_s: float) -> None:
    """TCP-connect to ``host:port`` of an explicit address (fast refusal instead of Ray's long retries)."""
    match = re.fullmatch(r"(?:ray://)?\[?([^\]\s]+?)\]?:(\d{1,5})", address.strip())
    if match is None:
        return
    host, port = match.group(1), int(match.group(2))
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise ExecutorUnavailableError(
            f"Ray cluster at rl.ray.address={address!r} is unreachable ({type(err).__name__}: {err}); start the cluster "
            "(`ray start --head`), fix the address, or set rl.executor = 'local'"
        ) from err


def connect(rl: RLConfig) -> float:
    """Connect this process to the cluster ``rl.ray.address`` names (no-op when already connected).

    ``local`` starts an in-process cluster on this host's CPUs/GPUs (kept for
    the process' lifetime). Returns the seconds it took.

    Raises:
        ExecutorUnavailableError: nothing answers at the address, or Ray did not
            connect within ``rl.ray.connect_timeout_s``.
    """
    import ray

    started = time.perf_counter()
    if ray.is_initialized():
        return 0.0
    address = rl.ray.address
    if address == "local":
        ray.init(include_dashboard=False, logging_level=logging.WARNING, ignore_reinit_error=True)
        return time.perf_counter() - started
    target = os.environ.get("RAY_ADDRESS", "") if address == "auto" else address
    if target and target != "auto":
        _probe(target, rl.ray.connect_timeout_s)
    failure: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(address=address, logging_level=logging.WARNING, ignore_reinit_error=True)
        except BaseException as err:  # reported to the caller below
            failure.append(err)

    thread = threading.Thread(target=init, name="ray-connect", daemon=True)
    thread.start()
    thread.join(rl.ray.connect_timeout_s)
    if thread.is_alive():
        raise ExecutorUnavailableError(
            f"Ray cluster at rl.ray.address={address!r} did not answer within rl.ray.connect_timeout_s="
            f"{rl.ray.connect_timeout_s:g}s; check the cluster (`ray status`), or set rl.executor = 'local'"
        )
    if failure:
        raise ExecutorUnavailableError(
            f"cannot connect to the Ray cluster at rl.ray.address={address!r}: {type(failure[0]).__name__}: {failure[0]}; "
            "start one (`ray start --head`), use 'local' for an in-process cluster, or set rl.executor = 'local'"
        ) from failure[0]
    return time.perf_counter() - started


def actor_count(rl: RLConfig, candidates: int, cluster: dict[str, float]) -> tuple[int, int]:
    """``(actors, gpus per actor)`` for a round: ``rl.ray.actors`` or one per GPU of the
    cluster (1 without GPUs), never more than the candidates."""
    gpus_total = int(cluster.get("GPU", 0))
    gpus = (1 if gpus_total > 0 else 0) if rl.ray.actor_gpus == "auto" else int(rl.ray.actor_gpus)
    wanted = rl.ray.actors or (gpus_total if gpus and gpus_total else 1)
    return max(1, min(wanted, candidates)), gpus


class Pool:
    """A placement group and its trainer actors. ``key``: (model config, bundle) they were made for;
    ``rounds``: rounds that trained on them so far; ``ready``: each actor's first ``pid()`` call,
    submitted at creation (resolves once the actor has started, raises if it could not)."""

    def __init__(self, key: tuple[str, str], bundle: dict[str, float], size: int) -> None:
        self.key, self.bundle, self.size = key, bundle, size
        self.group: Any = None
        self.actors: list[Any] = []
        self.ready: list[Any] = []
        self.rounds = 0
        self.placed = False
        self.started = False

    def alive(self, timeout_s: float = 5.0) -> bool:
        """False when an actor is known dead (or the cluster is gone). An actor still starting (placement
        or base load) counts as alive without waiting for it; a started one must answer within ``timeout_s``."""
        import ray

        if not self.actors:
            return False
        try:
            done, _ = ray.wait(self.ready, num_returns=len(self.ready), timeout=0)
            ray.get(done)  # raises for an actor that could not start
            finished = set(done)
            pings = [a.pid.remote() for a, r in zip(self.actors, self.ready) if r in finished]
            ray.get(pings, timeout=timeout_s)
            return True
        except Exception:  # RayActorError, a timeout, or ray.shutdown(): start afresh
            return False

    def close(self) -> None:
        """Kill the actors and remove the placement group (best effort: the cluster may be gone)."""
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as err:  # noqa: BLE001 - cleanup must not hide the round's own error
                log.warning("could not kill a trainer actor: %s", err)
        if self.group is not None:
            try:
                ray.util.remove_placement_group(self.group)
            except Exception as err:  # noqa: BLE001
                log.warning("could not remove placement group: %s", err)
        self.actors, self.ready, self.group = [], [], None


_LOCK = threading.RLock()  # orders acquire / release / warm of this process
_KEPT: dict[str, Pool] = {}  # at most one pool ("pool"), kept between rounds
_HELD: dict[str, Pool] = {}  # the pool a round holds ("pool"), if any


def _sizing(
    rl: RLConfig, model_cfg: ModelConfig, candidates: int
) -> tuple[tuple[str, str], dict[str, float], int, int]:
    """``(key, bundle, actors, gpus)`` of a round with ``candidates`` candidates on the connected cluster."""
    import ray

    actors, gpus = actor_count(rl, candidates, ray.cluster_resources())
    bundle = {"CPU": rl.ray.actor_cpus} | ({"GPU": float(gpus)} if gpus else {})
    return (model_cfg.model_dump_json(), json.dumps(bundle, sort_keys=True)), bundle, actors, gpus


def _create(rl: RLConfig, model_cfg: ModelConfig, sizing: tuple, name: str) -> Pool:
    """Request the placement group and submit the actors into it; returns at once."""
    from ray.util.placement_group import placement_group

    key, bundle, size, gpus = sizing
    pool = Pool(key, bundle, size)
    pool.group = placement_group([dict(bundle) for _ in range(size)], strategy="SPREAD", name=name)
    try:
        pool.actors = [_spawn(rl, model_cfg, pool.group, i, gpus) for i in range(size)]
        pool.ready = [a.pid.remote() for a in pool.actors]
    except BaseException:
        pool.close()
        raise
    return pool


def acquire(rl: RLConfig, model_cfg: ModelConfig, candidates: int, name: str) -> tuple[Pool, int, dict[str, float]]:
    """The pool a round trains on, held by the caller until :func:`release`: the kept one when it fits,
    else a new one (placement requested, actors starting; not waited for).

    Returns ``(pool, actors this round uses, metrics)`` with ``executor/connect_s``.

    Raises:
        ExecutorUnavailableError: the cluster does not answer (see :func:`connect`).
    """
    with _LOCK:
        metrics = {"executor/connect_s": connect(rl)}
        sizing = _sizing(rl, model_cfg, candidates)
        key, _, size, _ = sizing
        pool = _KEPT.pop("pool", None)
        if pool is not None and not (pool.key == key and pool.size >= size and pool.alive()):
            log.info("kept trainer actors do not fit this round (or one died); starting new ones")
            pool.close()
            pool = None
        if pool is None:
            pool = _create(rl, model_cfg, sizing, name)
        old = _HELD.pop("pool", None)
        if old is not None and old is not pool:  # a previous holder that never released (should not happen)
            old.close()
        _HELD["pool"] = pool
        return pool, size, metrics


def release(pool: Pool, keep: bool) -> None:
    """End a round's hold on ``pool``: keep it for the next round, or kill its actors and free its placement group."""
    with _LOCK:
        if _HELD.get("pool") is pool:
            del _HELD["pool"]
        if not keep:
            pool.close()
            return
        old, _KEPT["pool"] = _KEPT.get("pool"), pool
    if old is not None and old is not pool:
        old.close()


def warm(rl: RLConfig, model_cfg: ModelConfig, candidates: int) -> bool:
    """Start (place and load) the trainer actors of a round with ``candidates`` candidates now, and keep
    them for it; returns at once after connecting. False when a round holds the pool (nothing done).

    A kept pool that fits is left as is; one that does not is replaced.

    Raises:
        ExecutorUnavailableError: the cluster does not answer.
    """
    with _LOCK:
        if "pool" in _HELD:
            return False
        pool, _, _ = acquire(rl, model_cfg, candidates, f"hourglass-warm-{os.getpid()}")
        release(pool, keep=True)
        return True


def release_kept_actors() -> None:
    """Kill the trainer actors kept between rounds and free their placement group."""
    with _LOCK:
        pool = _KEPT.pop("pool", None)
    if pool is not None:
        pool.close()


def wait_placed(pool: Pool, rl: RLConfig, what: str, on_phase: Callable[[PhaseBoundary], None] | None) -> float:
    """Wait until the pool's placement group is placed (at most ``rl.ray.placement_timeout_s`` from now);
    returns the seconds waited. ``on_phase`` is called every few seconds (a cancel takes effect).

    Raises:
        PlacementTimeoutError: not placed in time (the cluster's free and total resources in the message).
    """
    import ray

    if pool.placed:
        return 0.0
    started = time.perf_counter()
    deadline = time.monotonic() + rl.ray.placement_timeout_s
    while True:
        remaining = deadline - time.monotonic()
        ready, _ = ray.wait([pool.group.ready()], timeout=max(0.0, min(5.0, remaining)))
        if ready:
            pool.placed = True
            return time.perf_counter() - started
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        if remaining <= 0:
            total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
            raise PlacementTimeoutError(
                f"{what}: could not reserve {pool.size} trainer actor(s) of {pool.bundle} within "
                f"rl.ray.placement_timeout_s={rl.ray.placement_timeout_s:g}s (cluster free: {free}, total: {total}); add "
                "nodes, lower rl.ray.actors / rl.ray.actor_cpus, or raise the timeout"
            )
        log.warning(
            "%s: waiting for %d trainer actor(s) of %s (cluster free: %s; %.0fs left)",
            what,
            pool.size,
            pool.bundle,
            free,
            remaining,
        )
        if on_phase is not None:
            on_phase(PhaseBoundary(RoundPhase.TRAIN, step=0))  # a cancel takes effect while waiting


def wait_started(pool: Pool, count: int, who: Callable[[int], str], on_phase: Callable | None) -> float:
    """Wait until the first ``count`` actors have started (base loaded); returns the seconds waited.

    Raises:
        ExecutorError: an actor could not start (its error, e.g. the base model missing on its node).
    """
    import ray
    from ray.exceptions import RayError

    if pool.started:
        return 0.0
    started = time.perf_counter()
    pending = {ref: i for i, ref in enumerate(pool.ready[:count])}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
        for ref in done:
            i = pending.pop(ref)
            try:
                ray.get(ref)
            except RayError as err:
                raise ExecutorError(f"{who(i)} could not start: {_first_line(err)}") from err
        if pending and on_phase is not None:
            on_phase(PhaseBoundary(RoundPhase.TRAIN, step=0))
    pool.started = count >= pool.size
    return time.perf_counter() - started


def _spawn(rl: RLConfig, model_cfg: ModelConfig, group: object, index: int, gpus: int) -> object:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=cast(Any, group), placement_group_bundle_index=index)
    options = {
        "num_cpus": rl.ray.actor_cpus,
        "num_gpus": gpus,
        "max_concurrency": 2,
        "max_restarts": 0,
        "max_task_retries": 0,
    }
    threads = None if gpus else max(1, int(rl.ray.actor_cpus))
    return ray.remote(TrainerActor).options(scheduling_strategy=strategy, **options).remote(model_cfg, threads)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
