"""The resident adapter store: every candidate is its own PEFT adapter on the
device, with its own AdamW; switching is ``set_adapter(name)``."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from trainer.model.base import BOOT_ADAPTER, ResidentBase, lora_config
from trainer.config import CandidateConfig
from trainer.errors import AdapterStoreError
from trainer.adapters.lora_tensors import (
    adapter_params,
    initial_weights,
    make_adamw,
    peft_name,
    set_trainable,
    snapshot_state,
    write_adapter,
)


def _requires_grad(optimizer: torch.optim.Optimizer, flag: bool) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.requires_grad_(flag)


class ResidentStore:
    """All candidates' adapters on the device; switch by name (PEFT ``set_adapter``)."""

    def __init__(self, base: ResidentBase, seed: int = 0) -> None:
        self.base = base
        self.seed = seed
        self.candidates: dict[str, CandidateConfig] = {}
        self.optimizers: dict[str, torch.optim.AdamW] = {}
        self.live: str | None = None
        self.last_swap_s = 0.0

    def names(self) -> list[str]:
        return list(self.candidates)

    def create(self, name: str, candidate: CandidateConfig, init_dir: Path | None = None) -> None:
        if name in self.candidates:
            raise AdapterStoreError(f"candidate {name!r} already exists in the store; delete it first")
        weights = initial_weights(self.base, name, candidate, init_dir, self.seed)
        self.base.model.add_adapter(peft_name(name), lora_config(candidate))
        params = adapter_params(self.base.model, peft_name(name))
        with torch.no_grad():
            for key, p in params.items():
                p.copy_(weights[key])
        self.candidates[name] = candidate
        self.optimizers[name] = make_adamw(list(params.values()), candidate.learning_rate)
        set_trainable(self.base.model, peft_name(self.live) if self.live else None)

    def delete(self, name: str) -> None:
        self._check(name)
        self.base.model.delete_adapter(peft_name(name))
        del self.candidates[name], self.optimizers[name]
        if self.live == name:
            self.live = None

    def activate(self, name: str) -> torch.optim.Optimizer:
        self._check(name)
        started = time.perf_counter()
        self.base.model.set_adapter(peft_name(name))  # walks every LoRA layer (PEFT)
        # Only the live adapter trains. PEFT's set_adapter does this too; made explicit
        # here on the two optimizers' parameters instead of a sweep over the whole model.
        if self.live is not None and self.live != name:
            _requires_grad(self.optimizers[self.live], False)
        _requires_grad(self.optimizers[name], True)
        self.live = name
        self.last_swap_s = time.perf_counter() - started
        return self.optimizers[name]

    def close(self) -> None:
        """Remove every candidate's adapter from the base (it stays resident, clean)."""
        for name in list(self.candidates):
            self.delete(name)
        self.base.model.set_adapter(BOOT_ADAPTER)
        set_trainable(self.base.model, None)  # set_adapter made the boot adapter trainable

    def save(self, name: str, out_dir: Path) -> Path:
        self._check(name)
        return write_adapter(
            adapter_params(self.base.model, peft_name(name)), self.candidates[name], self.base, out_dir
        )

    def snapshot(self, name: str) -> dict[str, torch.Tensor]:
        self._check(name)
        params = adapter_params(self.base.model, peft_name(name))
        return snapshot_state(params, self.optimizers[name])

    def _check(self, name: str) -> None:
        if name not in self.candidates:
            raise AdapterStoreError(f"unknown candidate {name!r}; the store holds {sorted(self.candidates)}")
