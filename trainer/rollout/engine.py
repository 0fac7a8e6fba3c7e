"""The rollout engine contract: sample G completions per prompt from named adapter versions.

One small Protocol, :class:`RolloutEngine`, and its request record; the engines:

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from trainer.errors import RolloutError
from trainer.types import Sample

log = logging.getLogger(__name__)

BASE_VERSION = "base"


@dataclass(frozen=True)
class RolloutRequest:
    """``n`` completions of one prompt from one adapter version.

    ``temperature == 0`` means greedy. ``prompt_token_ids`` already has the
    chat template applied (with the generation prompt).
    """

    version: str
    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    n: int
    max_new_tokens: int
    temperature: float = 1.0
    seed: int = 0


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
