"""The rollout engines by name (``[rl.rollout] engine``): the engine a round asks for."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from trainer.adapters.store import AdapterStore
from trainer.config import RLConfig, RolloutEngineKind
from trainer.errors import TrainerConfigError
from trainer.model.base import ResidentBase
from trainer.rollout.engine import RolloutEngine
from trainer.rollout.hf import HFEngine


def _hf(rl: RLConfig, base: ResidentBase, store: AdapterStore, order: Sequence[str]) -> RolloutEngine:
    return HFEngine(base, store)


def _vllm(rl: RLConfig, base: ResidentBase, store: AdapterStore, order: Sequence[str]) -> RolloutEngine:
    urls = list(rl.rollout.urls) or ([rl.rollout.url] if rl.rollout.url else [])
    if not urls:
        raise TrainerConfigError(
            "rollout engine 'vllm' needs rl.rollout.url (the vLLM server's base URL), or pass an engine"
        )
    from trainer.rollout.fleet import make_vllm_engine

    return make_vllm_engine(urls, order=order, adapter_share=rl.rollout.adapter_share_uri)  # several URLs: a fleet


ENGINES: dict[RolloutEngineKind, Callable[[RLConfig, ResidentBase, AdapterStore, Sequence[str]], RolloutEngine]] = {
    RolloutEngineKind.HF: _hf,
    RolloutEngineKind.VLLM: _vllm,
}


def make_engine(rl: RLConfig, base: ResidentBase, store: AdapterStore, order: Sequence[str] = ()) -> RolloutEngine:
    """The rollout engine the config asks for (``[rl.rollout] engine``); ``order``: the round's candidate
    names, the placement order of a vLLM fleet (:class:`trainer.rollout.fleet.FleetEngine`).

    Raises:
        TrainerConfigError: ``vllm`` without ``rl.rollout.url`` (or ``urls``).
    """
    return ENGINES[RolloutEngineKind(rl.rollout.engine)](rl, base, store, order)
