"""The rollout engines by name (``rl.rollout_engine``): the engine a round asks for."""

from __future__ import annotations

from collections.abc import Sequence

from trainer.adapters.store import AdapterStore
from trainer.config import RLConfig
from trainer.errors import TrainerConfigError
from trainer.model.base import ResidentBase
from trainer.rollout.engine import RolloutEngine
from trainer.rollout.hf import HFEngine


def make_engine(rl: RLConfig, base: ResidentBase, store: AdapterStore, order: Sequence[str] = ()) -> RolloutEngine:
    """The rollout engine the config asks for (``rl.rollout_engine``); ``order``: the round's candidate
    names, the placement order of a vLLM fleet (:class:`trainer.rollout.fleet.FleetEngine`).

    Raises:
        TrainerConfigError: ``vllm`` without ``rl.rollout_url``.
    """
    if rl.rollout_engine == "hf":
        return HFEngine(base, store)
    urls = list(rl.rollout_urls) or ([rl.rollout_url] if rl.rollout_url else [])
    if not urls:
        raise TrainerConfigError(
            "rollout_engine 'vllm' needs rl.rollout_url (the vLLM server's base URL), or pass engine="
        )
    from trainer.rollout.fleet import make_vllm_engine

    return make_vllm_engine(urls, order=order, adapter_share=rl.adapter_share_uri)  # several URLs: a FleetEngine
