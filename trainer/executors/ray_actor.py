"""The trainer actor of the ``ray`` executor: one resident base per actor; each round it trains a
share of the candidates with exactly the local executor's code (see :mod:`trainer.executors.ray_executor`)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from trainer.config import ModelConfig, RewardModelConfig
from trainer.executors.exchange import Exchange, local_scratch
from trainer.executors.local import LocalExecutor
from trainer.types import TrainJob

__all__ = ["TrainerActor"]


class TrainerActor:
    """One trainer worker: a resident base of its own; trains a share of a round's candidates.

    Created by :mod:`trainer.executors.ray_pool` inside a placement group; killed when the
    round ends unless the pool is kept. ``threads``: torch threads (CPU actors).
    """

    def __init__(self, model_cfg: ModelConfig, threads: int | None) -> None:
        import torch

        from trainer.model.base import load_base

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
        self,
        job: TrainJob,
        prompts: tuple,
        uri: str,
        remote_starts: list[str],
        index: int,
        order: Sequence[str] = (),
        reward_cfg: RewardModelConfig | None = None,
    ) -> str:
        """Train ``job.candidates`` through :class:`LocalExecutor`; put each final adapter at
        ``adapters/<name>/`` and the results at ``results/actor-<index>.json`` of the exchange.

        ``order``: every candidate of the round in config order (the vLLM fleet's placement);
        ``reward_cfg``: load the round's reward model from ``reward_model/`` of the exchange
        (its candidates on ``reward_model`` are scored with it). Returns the results' path
        relative to the exchange root."""
        from trainer.adapters.store import make_store
        from trainer.reward_model.model import create_reward_model
        from trainer.rollout.engine import unload_versions
        from trainer.rollout.engine import make_engine

        started = time.perf_counter()
        self.phase = "start"
        exchange = Exchange(uri, job.round_id)
        scratch = local_scratch(f"hourglass-{job.round_id}-actor{index}-")
        rl = job.rl
        store = make_store(rl.adapter_store, self.base, rl.seed)
        engine = make_engine(rl, self.base, store, order)
        names = {c.name for c in job.candidates}
        try:
            reward_model = None
            if reward_cfg is not None:
                folder = exchange.get_dir(scratch / "reward_model", "reward_model")
                reward_model = create_reward_model(self.base, store, reward_cfg, folder, rl.seed)
            starts: dict[str, Path | None] = {
                n: exchange.get_dir(scratch / "start" / n, "start", n) for n in remote_starts
            }
            local_job = replace(
                job,
                train_prompts=prompts,
                starts=starts,
                out_dir=scratch / "out",
                on_phase=self._mark,
            )
            outcome = LocalExecutor().train(local_job, self.base, store, engine, reward_model=reward_model)
            for c in job.candidates:
                exchange.put_dir(store.save(c.name, scratch / "final" / c.name), "adapters", c.name)
            for version in outcome.versions.values():
                engine.unload(version)
        finally:
            unload_versions(engine, names)
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
