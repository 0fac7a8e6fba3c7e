"""Where candidates' LoRA weights and AdamW state live between their turns.

Two stores behind one :class:`AdapterStore` Protocol (:func:`make_store` builds the one ``rl.adapter_store``
names):

- :class:`trainer.adapters.resident.ResidentStore`: every candidate is its own PEFT adapter on the
  device, with its own AdamW; switching is ``set_adapter(name)``.
- :class:`trainer.adapters.offload.OffloadStore`: one live adapter slot on the
  device. Every other candidate's LoRA weights, accumulated gradients and
  AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) wait in host memory
  (pinned when CUDA is available) as flat buffers and are copied into the
  slot for that candidate's turn (``non_blocking`` copies on CUDA). Device
  memory for adapters is one candidate's worth whatever K is.

Candidates never share optimizer state, step counts or gradients. They may
be created and deleted between steps. Adapter tensors are keyed by PEFT's
saved names (``...q_proj.lora_A.weight``, the adapter name removed), so a
saved folder loads in PEFT and in vLLM.

A round keeps every final adapter twice: under its own folder and as the candidate's ``last``
(:func:`keep_as_last`), the start point of the next round's ``start = "self"``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from connectors import atomic
from trainer.adapters.offload import OffloadStore
from trainer.adapters.resident import ResidentStore
from trainer.config import AdapterStoreKind, CandidateConfig
from trainer.errors import TrainerConfigError
from trainer.model.base import ResidentBase


class AdapterStore(Protocol):
    """Holds many candidates' adapters; exactly one is live at a time.

    ``base`` is the resident base the adapters live on; ``last_swap_s`` the
    wall time, in seconds, of the last :meth:`activate` (0 when nothing moved).
    """

    base: ResidentBase
    last_swap_s: float

    def create(self, name: str, candidate: CandidateConfig, init_dir: Path | None = None) -> None: ...
    def delete(self, name: str) -> None: ...
    def activate(self, name: str) -> torch.optim.Optimizer: ...
    def save(self, name: str, out_dir: Path) -> Path: ...
    def snapshot(self, name: str) -> dict[str, torch.Tensor]: ...
    def names(self) -> list[str]: ...
    def close(self) -> None: ...


STORES: dict[AdapterStoreKind, Callable[[ResidentBase, int], AdapterStore]] = {
    AdapterStoreKind.RESIDENT: ResidentStore,
    AdapterStoreKind.OFFLOAD: OffloadStore,
}
"""The adapter stores by name (``rl.adapter_store``)."""


def make_store(kind: str, base: ResidentBase, seed: int = 0) -> AdapterStore:
    """The store ``kind`` names (``rl.adapter_store``: ``resident`` or ``offload``) on ``base``.

    Raises:
        TrainerConfigError: any other kind.
    """
    try:
        return STORES[AdapterStoreKind(kind)](base, seed)
    except ValueError:
        raise TrainerConfigError(f"adapter_store {kind!r} must be one of {[k.value for k in STORES]}") from None


def keep_as_last(folder: Path, out_dir: Path, name: str) -> Path:
    """Copy the saved adapter ``folder`` of ``name`` (a candidate or the reward model) to
    ``out_dir.parent / "last" / name``, replacing the previous round's in one step (a crash leaves the old
    one or the new one, never half of either). Returns the ``last`` folder."""
    return atomic.copy_dir(folder, out_dir.parent / "last" / name)
