"""The adapter stores by name (``rl.adapter_store``): where idle candidates wait between their turns."""

from __future__ import annotations

from trainer.adapters.store import AdapterStore
from trainer.model.base import ResidentBase
from trainer.errors import TrainerConfigError
from trainer.adapters.offload import OffloadStore
from trainer.adapters.resident import ResidentStore


def make_store(kind: str, base: ResidentBase, seed: int = 0) -> AdapterStore:
    """``resident`` or ``offload`` (``RLConfig.adapter_store``).

    Raises:
        TrainerConfigError: any other kind.
    """
    if kind == "resident":
        return ResidentStore(base, seed)
    if kind == "offload":
        return OffloadStore(base, seed)
    raise TrainerConfigError(f"adapter_store {kind!r} must be 'resident' or 'offload'")
