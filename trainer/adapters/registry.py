"""The adapter stores by name (``rl.adapter_store``): where idle candidates wait between their turns."""

from __future__ import annotations

from collections.abc import Callable

from trainer.adapters.offload import OffloadStore
from trainer.adapters.resident import ResidentStore
from trainer.adapters.store import AdapterStore
from trainer.config import AdapterStoreKind
from trainer.errors import TrainerConfigError
from trainer.model.base import ResidentBase

STORES: dict[AdapterStoreKind, Callable[[ResidentBase, int], AdapterStore]] = {
    AdapterStoreKind.RESIDENT: ResidentStore,
    AdapterStoreKind.OFFLOAD: OffloadStore,
}


def make_store(kind: str, base: ResidentBase, seed: int = 0) -> AdapterStore:
    """The store ``kind`` names (``rl.adapter_store``: ``resident`` or ``offload``) on ``base``.

    Raises:
        TrainerConfigError: any other kind.
    """
    try:
        return STORES[AdapterStoreKind(kind)](base, seed)
    except ValueError:
        raise TrainerConfigError(f"adapter_store {kind!r} must be one of {[k.value for k in STORES]}") from None
