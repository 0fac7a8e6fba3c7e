"""The rollout engine contract: sample G completions per prompt from named adapter versions.

One small Protocol, :class:`RolloutEngine` (its request record, :class:`~trainer.types.RolloutRequest`, is
in the vocabulary), and :func:`make_engine`, which builds the one ``[rl.rollout] engine`` names:

- :class:`trainer.rollout.hf.HFEngine`: transformers ``generate`` on the resident base,
  for hosts without vLLM and for small tests; one adapter at a time.
- :class:`trainer.rollout.vllm.VLLMEngine`: a vLLM OpenAI-compatible server
  with runtime LoRA loading; all adapters' requests in flight together.
- :class:`trainer.rollout.fleet.FleetEngine`: several vLLM replicas, each candidate pinned to one.

Adapter versions are names (``<candidate>-s<step>``); ``base`` is the base
model with no adapter. A version is loaded once and never reloaded in place
under the same name. Every returned :class:`~trainer.types.Sample` carries
the version that produced it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trainer.config import RLConfig, RolloutEngineKind
from trainer.errors import RolloutError, TrainerConfigError
from trainer.types import RolloutRequest, Sample

if TYPE_CHECKING:
    from trainer.adapters.store import AdapterStore
    from trainer.model.base import ResidentBase

log = logging.getLogger(__name__)


class RolloutEngine(Protocol):
    """Loads adapter versions by name and samples from them."""

    def load(self, candidate: str, version: str, adapter_dir: Path) -> None: ...
    def unload(self, version: str) -> None: ...
    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[Sample]]: ...


def unload_versions(engine: RolloutEngine, candidates: set[str]) -> None:
    """Unload every version of these candidates the engine still has (after an error or a cancel); an
    engine that cannot unload one is logged, not raised (cleanup must not hide the round's own error)."""
    loaded = getattr(engine, "versions", {})
    for version in [v for v, candidate in list(loaded.items()) if candidate in candidates]:
        try:
            engine.unload(version)
        except RolloutError as err:
            log.warning("could not unload %s after the round: %s", version, err)


def _hf(rl: RLConfig, base: ResidentBase, store: AdapterStore, order: Sequence[str]) -> RolloutEngine:
    from trainer.rollout.hf import HFEngine  # torch: imported when chosen

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
"""The rollout engines by name (``[rl.rollout] engine``)."""


def make_engine(rl: RLConfig, base: ResidentBase, store: AdapterStore, order: Sequence[str] = ()) -> RolloutEngine:
    """The rollout engine the config asks for (``[rl.rollout] engine``); ``order``: the round's candidate
    names, the placement order of a vLLM fleet (:class:`trainer.rollout.fleet.FleetEngine`).

    Raises:
        TrainerConfigError: ``vllm`` without ``rl.rollout.url`` (or ``urls``).
    """
    return ENGINES[RolloutEngineKind(rl.rollout.engine)](rl, base, store, order)
