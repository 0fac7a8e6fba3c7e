"""Where candidates' LoRA weights and AdamW state live between their turns.

Two stores behind one :class:`AdapterStore` Protocol (:mod:`trainer.adapters.registry` names them):

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
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from trainer.model.base import ResidentBase
from trainer.config import CandidateConfig


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
