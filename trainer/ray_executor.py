"""The ``ray`` executor: a round's candidates trained by actors on a Ray cluster.

What runs where (one round):

- the round driver (the service, or ``hourglass round``) connects to the
  cluster (``rl.ray_address``; a clear :class:`ExecutorUnavailableError`
  after ``rl.ray_connect_timeout_s``), reserves one placement group bundle per
  trainer actor (``rl.ray_actor_cpus`` CPUs and, on GPU clusters, 1 GPU each)
  and waits for it at most ``rl.ray_placement_timeout_s``
  (:class:`PlacementTimeoutError` with the cluster's free resources);
- each :class:`TrainerActor` loads its own resident base, makes its own
  adapter store and rollout engine (``rl.rollout_engine`` / ``rl.rollout_url``:
  the vLLM server(s) from config, or transformers on the actor), and trains its
  share of the candidates (:func:`trainer.executor.assign`) with
  :class:`trainer.executor.LocalExecutor` — the local code path, unchanged;
- start adapters go out and trained adapters and per-actor results come back
  through ``<rl.ray_storage_uri>/<round_id>/`` (:class:`trainer.executor.Exchange`,
  any ``pyarrow.fs`` filesystem): ``start/<candidate>/``,
  ``adapters/<candidate>/``, ``results/actor-<i>.json``;
- the driver loads every trained adapter into its own store and engine, and
  the round evaluates and gates all candidates together, as with ``local``.

Whatever happens (success, an actor killed mid-round, a cancel, a timeout),
the round's actors are killed, its placement group is removed and its
exchange folder is deleted before :meth:`RayExecutor.train` returns or raises.
The one exception is opt-in: with ``rl.ray_keep_actors`` a *successful*
round keeps its placement group and actors (their resident bases loaded) for
the next round of this process with the same model and sizing, which then
skips the actor start-up; :func:`release_kept_actors` frees them.
Upstream API: https://docs.ray.io/en/latest/ray-core/scheduling/placement-group.html
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from trainer.config import ModelConfig, RLConfig, uses_reward_model
from trainer.errors import (
    ExecutorError,
    ExecutorUnavailableError,
    PlacementTimeoutError,
    TrainerConfigError,
    TrainerError,
)
from trainer.types import PhaseBoundary, RoundPhase
from trainer.executor import Exchange, LocalExecutor, Routines, TrainJob, TrainOutcome, assign, local_scratch

log = logging.getLogger(__name__)

__all__ = ["RayExecutor", "TrainerActor", "actor_count", "connect", "release_kept_actors"]

POLL_S = 1.0  # how often the driver checks actors, progress and a cancel


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
            f"Ray cluster at rl.ray_address={address!r} is unreachable ({type(err).__name__}: {err}); start the cluster "
            "(`ray start --head`), fix the address, or set rl.executor = 'local'"
        ) from err


def connect(rl: RLConfig) -> float:
    """Connect this process to the cluster ``rl.ray_address`` names (no-op when already connected).

    ``local`` starts an in-process cluster on this host's CPUs/GPUs (kept for
    the process' lifetime). Returns the seconds it took.

    Raises:
        ExecutorUnavailableError: nothing answers at the address, or Ray did not
            connect within ``rl.ray_connect_timeout_s``.
    """
    import ray

    started = time.perf_counter()
    if ray.is_initialized():
        return 0.0
    address = rl.ray_address
    if address == "local":
        ray.init(include_dashboard=False, logging_level=logging.WARNING, ignore_reinit_error=True)
        return time.perf_counter() - started
    target = os.environ.get("RAY_ADDRESS", "") if address == "auto" else address
    if target and target != "auto":
        _probe(target, rl.ray_connect_timeout_s)
    failure: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(address=address, logging_level=logging.WARNING, ignore_reinit_error=True)
        except BaseException as err:  # reported to the caller below
            failure.append(err)

    thread = threading.Thread(target=init, name="ray-connect", daemon=True)
    thread.start()
    thread.join(rl.ray_connect_timeout_s)
    if thread.is_alive():
        raise ExecutorUnavailableError(
            f"Ray cluster at rl.ray_address={address!r} did not answer within rl.ray_connect_timeout_s="
            f"{rl.ray_connect_timeout_s:g}s; check the cluster (`ray status`), or set rl.executor = 'local'"
        )
    if failure:
        raise ExecutorUnavailableError(
            f"cannot connect to the Ray cluster at rl.ray_address={address!r}: {type(failure[0]).__name__}: {failure[0]}; "
            "start one (`ray start --head`), use 'local' for an in-process cluster, or set rl.executor = 'local'"
        ) from failure[0]
    return time.perf_counter() - started


def actor_count(rl: RLConfig, candidates: int, cluster: dict[str, float]) -> tuple[int, int]:
    """``(actors, gpus per actor)`` for a round: ``rl.ray_actors`` or one per GPU of the
    cluster (1 without GPUs), never more than the candidates."""
    gpus_total = int(cluster.get("GPU", 0))
    gpus = (1 if gpus_total > 0 else 0) if rl.ray_actor_gpus == "auto" else int(rl.ray_actor_gpus)
    wanted = rl.ray_actors or (gpus_total if gpus and gpus_total else 1)
    return max(1, min(wanted, candidates)), gpus


class TrainerActor:
    """One trainer worker: a resident base of its own; trains a share of a round's candidates.

    Created by :class:`RayExecutor` inside the round's placement group and
    killed when the round ends. ``threads``: torch threads (CPU actors).
    """

    def __init__(self, model_cfg: ModelConfig, threads: int | None) -> None:
        import torch

        from trainer.base import load_base

        started = time.perf_counter()
        if threads:
            torch.set_num_threads(threads)
        self.base = load_base(model_cfg)
        self.load_s = time.perf_counter() - started
        self.phase = "loaded"

    def pid(self) -> int:
        return os.getpid()

    def progress(self) -> str:
        """The last phase the actor's training reached (``train:<step>``)."""
        return self.phase

    def _mark(self, boundary: object) -> None:
        self.phase = str(getattr(boundary, "label", boundary))  # a PhaseBoundary: "train:<step>"

    def train(
        self, routines: Routines, job: TrainJob, prompts: tuple, uri: str, remote_starts: list[str], index: int
    ) -> str:
        """Train ``job.candidates`` through :class:`LocalExecutor`; put each final adapter at
        ``adapters/<name>/`` and the results at ``results/actor-<index>.json`` of the exchange.
        Returns the results' path relative to the exchange root."""
        from trainer.adapter_store import make_store

        started = time.perf_counter()
        self.phase = "start"
        exchange = Exchange(uri, job.round_id)
        scratch = local_scratch(f"hourglass-{job.round_id}-actor{index}-")
        rl = job.rl
        store = make_store(rl.adapter_store, self.base, rl.seed)
        engine = routines.make_engine(rl, self.base, store)
        names = {c.name for c in job.candidates}
        try:
            starts: dict[str, Path | None] = {
                n: exchange.get_dir(scratch / "start" / n, "start", n) for n in remote_starts
            }
            local_job = replace(
                job, train_prompts=prompts, starts=starts, out_dir=scratch / "out", checkpoint=self._mark
            )
            outcome = LocalExecutor(routines).train(local_job, self.base, store, engine)
            for c in job.candidates:
                exchange.put_dir(store.save(c.name, scratch / "final" / c.name), "adapters", c.name)
            for version in outcome.versions.values():
                engine.unload(version)
        finally:
            routines.unload_leftovers(engine, names)
            for name in list(store.names()):
                store.delete(name)
            store.close()
            shutil.rmtree(scratch, ignore_errors=True)
        result = {
            "candidates": sorted(names),
            "history": outcome.history,
            "versions": outcome.versions,
            "rollout": outcome.rollout_metrics,
            "busy_s": time.perf_counter() - started,
            "load_s": self.load_s,
            "pid": os.getpid(),
        }
        exchange.put_text(json.dumps(result), "results", f"actor-{index}.json")
        self.phase = "done"
        return f"results/actor-{index}.json"


class RayExecutor:
    """Trains a round's candidates on trainer actors of a Ray cluster (see the module docstring);
    ``routines``: the round's training functions, run by each actor through :class:`LocalExecutor`."""

    def __init__(self, routines: Routines) -> None:
        self.routines = routines

    def train(self, job: TrainJob, base: object, store: object, engine: object) -> TrainOutcome:
        """Raises:
        ExecutorUnavailableError: the cluster does not answer.
        PlacementTimeoutError: the actors could not all be placed in time.
        ExecutorError: an actor died or failed; nothing of the round is kept.
        TrainerConfigError: a candidate whose reward uses ``reward_model`` (not distributed yet).
        A :class:`~trainer.errors.TrainerError` an actor raised (e.g. ``DataError``) is re-raised as is.
        """
        import ray

        scored = [c.name for c in job.candidates if uses_reward_model(c)]
        if scored:
            raise TrainerConfigError(
                f"candidates {scored} use reward 'reward_model', which rl.executor = 'ray' cannot ship to actors yet; use rl.executor = 'local' for them"
            )
        rl = job.rl
        metrics = {"executor/connect_s": connect(rl)}
        actors_n, gpus = actor_count(rl, len(job.candidates), ray.cluster_resources())
        shares = [s for s in assign(job.candidates, rl, actors_n) if s]
        exchange = Exchange(rl.ray_storage_uri or str((job.out_dir / "exchange").resolve()), job.round_id)
        bundle = {"CPU": rl.ray_actor_cpus} | ({"GPU": float(gpus)} if gpus else {})
        key = (job.model_cfg.model_dump_json(), json.dumps(bundle, sort_keys=True), len(shares))
        pool, kept = _take_pool(key), False
        try:
            remote_starts = []
            for name, folder in job.starts.items():
                if folder is not None:
                    exchange.put_dir(folder, "start", name)
                    remote_starts.append(name)
            if pool is None:
                pool = _Pool(key)
                pool.group, metrics["executor/placement_wait_s"] = _reserve(job, bundle, len(shares))
                pool.actors = [_spawn(rl, job.model_cfg, pool.group, i, gpus) for i in range(len(shares))]
            else:
                metrics["executor/placement_wait_s"] = 0.0
            metrics["executor/actors_reused"] = float(pool.reused)
            started = time.perf_counter()
            prompts = ray.put(job.train_prompts)
            refs = {}
            for i, share in enumerate(shares):
                sub = replace(
                    job,
                    candidates=tuple(share),
                    train_prompts=(),
                    starts={},
                    checkpoint=None,
                    reward_model=None,
                    progress=False,
                    plan=None,
                )
                refs[
                    pool.actors[i].train.remote(
                        self.routines,
                        sub,
                        prompts,
                        exchange.uri,
                        [n for n in remote_starts if n in {c.name for c in share}],
                        i,
                    )
                ] = i
            paths = _await(job, pool.actors, shares, refs)
            wall = time.perf_counter() - started
            outcome = _collect(job, exchange, paths, shares, store, engine, metrics, wall)
            kept = rl.ray_keep_actors
            return outcome
        finally:
            if pool is not None:
                _keep_pool(pool) if kept else pool.close()
            exchange.remove()


class _Pool:
    """A round's placement group and trainer actors (kept between rounds with ``rl.ray_keep_actors``)."""

    def __init__(self, key: tuple) -> None:
        self.key, self.reused = key, False
        self.group: Any = None
        self.actors: list[Any] = []

    def alive(self) -> bool:
        import ray

        try:
            ray.get([a.pid.remote() for a in self.actors], timeout=30)
            return bool(self.actors)
        except Exception:  # dead actor, or the cluster is gone (ray.shutdown): start afresh
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
        self.actors, self.group = [], None


_KEPT: dict[str, _Pool] = {}  # at most one pool ("pool"), kept between rounds of this process
_KEPT_LOCK = threading.Lock()


def _take_pool(key: tuple) -> _Pool | None:
    """The kept pool when it fits this round (same model, bundle, size) and every actor answers; else None
    (a kept pool that does not fit is closed)."""
    with _KEPT_LOCK:
        pool = _KEPT.pop("pool", None)
    if pool is None:
        return None
    if pool.key == key and pool.alive():
        pool.reused = True
        return pool
    pool.close()
    return None


def _keep_pool(pool: _Pool) -> None:
    with _KEPT_LOCK:
        old, _KEPT["pool"] = _KEPT.get("pool"), pool
    if old is not None:
        old.close()


def release_kept_actors() -> None:
    """Kill the trainer actors kept between rounds (``rl.ray_keep_actors``) and free their placement group."""
    with _KEPT_LOCK:
        pool = _KEPT.pop("pool", None)
    if pool is not None:
        pool.close()


def _reserve(job: TrainJob, bundle: dict[str, float], count: int) -> tuple[object, float]:
    """A placement group of ``count`` bundles, ready; waits at most ``rl.ray_placement_timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    started = time.perf_counter()
    group = placement_group([dict(bundle) for _ in range(count)], strategy="SPREAD", name=f"hourglass-{job.round_id}")
    deadline = time.monotonic() + job.rl.ray_placement_timeout_s
    try:
        while True:
            remaining = deadline - time.monotonic()
            ready, _ = ray.wait([group.ready()], timeout=max(0.0, min(5.0, remaining)))
            if ready:
                return group, time.perf_counter() - started
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            if remaining <= 0:
                raise PlacementTimeoutError(
                    f"round {job.round_id}: could not reserve {count} trainer actor(s) of {bundle} within "
                    f"rl.ray_placement_timeout_s={job.rl.ray_placement_timeout_s:g}s (cluster free: {free}, total: "
                    f"{ {k: v for k, v in ray.cluster_resources().items() if k in ('CPU', 'GPU')} }); add nodes, lower "
                    "rl.ray_actors / rl.ray_actor_cpus, or raise the timeout"
                )
            log.warning(
                "round %s: waiting for %d trainer actor(s) of %s (cluster free: %s; %.0fs left)",
                job.round_id,
                count,
                bundle,
                free,
                remaining,
            )
            if job.checkpoint is not None:
                job.checkpoint(PhaseBoundary(RoundPhase.TRAIN, step=0))  # a cancel takes effect while waiting
    except BaseException:
        remove_placement_group(group)
        raise


def _spawn(rl: RLConfig, model_cfg: ModelConfig, group: object, index: int, gpus: int) -> object:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=cast(Any, group), placement_group_bundle_index=index)
    options = {
        "num_cpus": rl.ray_actor_cpus,
        "num_gpus": gpus,
        "max_concurrency": 2,
        "max_restarts": 0,
        "max_task_retries": 0,
    }
    threads = None if gpus else max(1, int(rl.ray_actor_cpus))
    return ray.remote(TrainerActor).options(scheduling_strategy=strategy, **options).remote(model_cfg, threads)


def _await(job: TrainJob, actors: list, shares: list, refs: dict) -> dict[int, str]:
    """Results of every actor; a cancel (``job.checkpoint``) is checked every :data:`POLL_S`.

    Raises ExecutorError on an actor's death, or re-raises a TrainerError it raised."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

    pending, paths, step = dict(refs), {}, 0
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        for ref in ready:
            i = pending.pop(ref)
            who = f"trainer actor {i} (candidates {[c.name for c in shares[i]]})"
            try:
                paths[i] = ray.get(ref)
            except RayActorError as err:
                raise ExecutorError(
                    f"{who} died mid-round: {_first_line(err)}; the round keeps nothing it trained"
                ) from err
            except RayTaskError as err:
                if isinstance(err.cause, TrainerError):
                    raise err.cause from err
                raise ExecutorError(f"{who} failed: {type(err.cause).__name__}: {err.cause}") from err
            except RayError as err:  # e.g. OutOfMemoryError: Ray's memory monitor killed the worker
                raise ExecutorError(
                    f"{who} was lost mid-round: {type(err).__name__}: {_first_line(err)}; the round keeps nothing it trained"
                ) from err
        if pending and job.checkpoint is not None:
            try:
                phases = ray.get([actors[i].progress.remote() for i in pending.values()], timeout=POLL_S)
                step = min([int(p.split(":")[1]) for p in phases if p.startswith("train:")], default=step)
            except (RayError, GetTimeoutError):
                pass  # still starting, or dead (its train() reference says so)
            job.checkpoint(PhaseBoundary(RoundPhase.TRAIN, step=step))  # a cancel takes effect here
    return paths


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _collect(
    job: TrainJob,
    exchange: Exchange,
    paths: dict[int, str],
    shares: list,
    store: object,
    engine: object,
    metrics: dict[str, float],
    wall: float,
) -> TrainOutcome:
    """Read every actor's results, load every trained adapter into the driver's store and engine."""
    history: dict[str, Any] = {}
    versions: dict[str, Any] = {}
    rollout = {"rollout/s": 0.0, "rollout/tokens": 0.0}
    for i in sorted(paths):
        result = json.loads(exchange.get_text(paths[i]))
        history |= result["history"]
        versions |= result["versions"]
        for key in rollout:
            rollout[key] += result["rollout"].get(key, 0.0)
        metrics |= {
            f"executor/actor{i}/busy_s": result["busy_s"],
            f"executor/actor{i}/load_s": result["load_s"],
            f"executor/actor{i}/utilisation": result["busy_s"] / max(wall, 1e-9),
        }
    rollout["rollout/tokens_per_s"] = rollout["rollout/tokens"] / max(rollout["rollout/s"], 1e-9)
    for share in shares:
        for c in share:
            folder = exchange.get_dir(
                job.out_dir / c.name / "versions" / versions[c.name].rsplit("-", 1)[1], "adapters", c.name
            )
            store.create(c.name, c, folder)  # type: ignore[attr-defined]
            engine.load(c.name, versions[c.name], folder)  # type: ignore[attr-defined]
    metrics |= {"executor/actors": float(len(shares)), "executor/train_wall_s": wall}
    return TrainOutcome(history, versions, rollout, metrics)
