"""The offload adapter store: one live LoRA slot on the device, every other
candidate waiting in host memory.

Each adapter shape (rank, alpha, target modules) has a :class:`Layout`: its
LoRA tensors, in PEFT's saved-key order, packed end to end in one flat
buffer. The device slot's parameters, gradients and AdamW moments are views
into four flat device buffers, and each waiting candidate keeps the same
four fields as flat host buffers (pinned on CUDA hosts). A swap is then a
handful of large copies (``non_blocking`` on CUDA) instead of one small copy
per LoRA tensor and field: on an H200 with SmolLM2's shape (420 LoRA
tensors) that was 48 ms per swap, launch-bound (see ``bench/adapter_swap.py``).

Candidates never share optimizer state, step counts or gradients.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.model.base import BOOT_ADAPTER, ResidentBase, lora_config
from trainer.config import CandidateConfig
from trainer.errors import AdapterStoreError
from trainer.adapters.lora_tensors import (
    SLOT,
    adapter_params,
    initial_weights,
    make_adamw,
    set_trainable,
    snapshot_state,
    write_adapter,
)

_MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state tensors (torch.optim.AdamW)


@dataclass(frozen=True)
class Layout:
    """Where each LoRA tensor of one adapter shape sits in a flat buffer.

    ``keys`` are PEFT's saved names (sorted); tensor ``keys[i]`` of shape
    ``shapes[i]`` occupies ``flat[offsets[i] : offsets[i] + numel(shapes[i])]``.
    """

    keys: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> Layout:
        """The layout of ``tensors`` (all of one dtype).

        Raises:
            AdapterStoreError: the tensors have more than one dtype.
        """
        keys = tuple(sorted(tensors))
        dtypes = {tensors[k].dtype for k in keys}
        if len(dtypes) != 1:
            raise AdapterStoreError(
                f"LoRA tensors of one adapter have several dtypes {sorted(map(str, dtypes))}; expected one"
            )
        offsets, total = [], 0
        for k in keys:
            offsets.append(total)
            total += tensors[k].numel()
        return cls(keys, tuple(tensors[k].shape for k in keys), tuple(offsets), total, dtypes.pop())

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{key: view of flat}`` in the tensors' own shapes (no copy)."""
        return {k: flat[o : o + s.numel()].view(s) for k, s, o in zip(self.keys, self.shapes, self.offsets)}

    def empty(self, device: torch.device | str, pin: bool = False) -> torch.Tensor:
        """An uninitialised flat buffer ``[numel]`` for this layout."""
        return torch.empty(self.numel, dtype=self.dtype, device=device, pin_memory=pin)


@dataclass
class _Waiting:
    """One waiting candidate: flat host buffers ``[layout.numel]`` (pinned on CUDA hosts).

    ``grads`` holds accumulated gradients of ``grad_keys`` only (None: no
    gradient pending). ``exp_avg`` / ``exp_avg_sq`` are None until the
    candidate's first optimizer step; ``step`` holds AdamW's CPU step
    counters by key, handed to the optimizer as they are (AdamW increments
    them in place).
    """

    candidate: CandidateConfig
    layout: Layout
    weights: torch.Tensor
    grads: torch.Tensor | None = None
    grad_keys: frozenset[str] = frozenset()
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    step: dict[str, torch.Tensor] = field(default_factory=dict)


class OffloadStore:
    """One live LoRA slot on the device; everyone else waits in host memory.

    The slot is a PEFT adapter (``SLOT``) rebuilt only when the next
    candidate's LoRA shape (rank, alpha, target modules) differs. One AdamW
    runs over the slot; each candidate's moments and step counts are copied
    in and out with its weights. ``last_swap_s`` is the wall time of the last
    activation (copy out + copy in, including the CPU-GPU sync).
    """

    def __init__(self, base: ResidentBase, seed: int = 0) -> None:
        self.base = base
        self.seed = seed
        self.pin = torch.cuda.is_available() and base.device.type == "cuda"
        self.host: dict[str, _Waiting] = {}
        self.live: str | None = None
        self.slot_shape: tuple | None = None
        self.slot_layout: Layout | None = None
        self.slot_params: dict[str, torch.nn.Parameter] = {}
        self.flat: dict[str, torch.Tensor] = {}  # "weights", "grads", "exp_avg", "exp_avg_sq": device [numel]
        self.views: dict[str, dict[str, torch.Tensor]] = {}  # the same, by LoRA key
        self.optimizer: torch.optim.AdamW | None = None
        self.last_swap_s = 0.0

    def names(self) -> list[str]:
        return list(self.host)

    def host_bytes(self) -> int:
        """Host memory held by waiting candidates (weights, gradients, moments), bytes."""
        buffers = (
            b for s in self.host.values() for b in (s.weights, s.grads, s.exp_avg, s.exp_avg_sq) if b is not None
        )
        return sum(b.numel() * b.element_size() for b in buffers)

    def _sync(self) -> None:
        if self.base.device.type == "cuda":
            torch.cuda.synchronize(self.base.device)  # CPU-GPU sync point: host buffers readable after this

    def create(self, name: str, candidate: CandidateConfig, init_dir: Path | None = None) -> None:
        if name in self.host:
            raise AdapterStoreError(f"candidate {name!r} already exists in the store; delete it first")
        weights = initial_weights(self.base, name, candidate, init_dir, self.seed)
        layout = Layout.of(weights)
        flat = layout.empty("cpu", self.pin)
        for key, view in layout.views(flat).items():
            view.copy_(weights[key])
        self.host[name] = _Waiting(candidate=candidate, layout=layout, weights=flat)

    def delete(self, name: str) -> None:
        self._check(name)
        if self.live == name:
            self.live = None  # its slot contents are simply dropped
        del self.host[name]

    def activate(self, name: str) -> torch.optim.Optimizer:
        self._check(name)
        if self.live == name and self.optimizer is not None and self.base.model.active_adapter == SLOT:
            self.last_swap_s = 0.0
            return self.optimizer
        started = time.perf_counter()
        if self.live is not None:
            self._copy_out(self.host[self.live])
            self.live = None  # its state is safe in host memory; if the rest fails, nobody is live
        state = self.host[name]
        self._ensure_slot(state.candidate)
        self._copy_in(state)
        self.live = name
        self._sync()
        self.last_swap_s = time.perf_counter() - started
        assert self.optimizer is not None
        return self.optimizer

    def _ensure_slot(self, candidate: CandidateConfig) -> None:
        shape = (candidate.lora_rank, candidate.lora_alpha, tuple(sorted(candidate.target_modules)))
        if shape != self.slot_shape:
            had_slot = self.slot_shape is not None
            self.slot_shape, self.slot_layout, self.optimizer = None, None, None  # no slot until the new one is built
            if had_slot:
                self.base.model.delete_adapter(SLOT)
            cuda = [self.base.device.index or 0] if self.base.device.type == "cuda" else []
            with torch.random.fork_rng(
                devices=cuda
            ):  # the slot's init values are overwritten: leave the RNG (rollout seeds) alone
                self.base.model.add_adapter(SLOT, lora_config(candidate))
            self.slot_params = adapter_params(self.base.model, SLOT)
            layout = Layout.of({k: p.detach() for k, p in self.slot_params.items()})
            self.flat = {f: layout.empty(self.base.device) for f in ("weights", "grads", *_MOMENTS)}
            self.views = {f: layout.views(buf) for f, buf in self.flat.items()}
            with torch.no_grad():
                for key, p in self.slot_params.items():
                    p.data = self.views["weights"][key]  # the slot's parameters live in the flat buffer
            self.slot_layout, self.slot_shape = layout, shape
            self.optimizer = make_adamw(list(self.slot_params.values()), candidate.learning_rate)
        if self.base.model.active_adapter != SLOT:  # set_adapter walks every module: only when needed
            self.base.model.set_adapter(SLOT)
            set_trainable(self.base.model, SLOT)

    def _copy_in(self, state: _Waiting) -> None:
        assert self.optimizer is not None and self.slot_layout is not None
        if state.layout != self.slot_layout:
            raise AdapterStoreError(
                f"candidate {state.candidate.name!r}: its LoRA layout does not match the slot built for it"
            )
        self.optimizer.param_groups[0]["lr"] = state.candidate.learning_rate
        nb = self.pin
        self.flat["weights"].copy_(state.weights, non_blocking=nb)
        if state.grads is not None:
            self.flat["grads"].copy_(state.grads, non_blocking=nb)
        grads = self.views["grads"]
        for key, p in self.slot_params.items():
            p.grad = grads[key] if key in state.grad_keys else None
        if state.exp_avg is None or state.exp_avg_sq is None:
            for p in self.slot_params.values():
                self.optimizer.state.pop(p, None)  # never stepped: AdamW starts from zeros
            return
        self.flat["exp_avg"].copy_(state.exp_avg, non_blocking=nb)
        self.flat["exp_avg_sq"].copy_(state.exp_avg_sq, non_blocking=nb)
        m, v = self.views["exp_avg"], self.views["exp_avg_sq"]
        for key, p in self.slot_params.items():
            if key in state.step:
                self.optimizer.state[p] = {"step": state.step[key], "exp_avg": m[key], "exp_avg_sq": v[key]}
            else:
                self.optimizer.state.pop(p, None)

    def _copy_out(self, state: _Waiting) -> None:
        assert self.optimizer is not None
        nb = self.pin
        layout = state.layout
        with torch.no_grad():
            # Tensors autograd or AdamW allocated themselves (first backward after
            # zero_grad(set_to_none), first step) are moved into the flat views once.
            grad_keys = frozenset(k for k, p in self.slot_params.items() if p.grad is not None)
            for key in grad_keys:
                p = self.slot_params[key]
                if (grad := p.grad) is not None:  # always: grad_keys are the keys with a gradient
                    p.grad = _adopted(grad, self.views["grads"][key])
            stepped = {}
            for key, p in self.slot_params.items():
                slot_state = self.optimizer.state.get(p)
                if slot_state and "exp_avg" in slot_state:
                    for f in _MOMENTS:
                        slot_state[f] = _adopted(slot_state[f], self.views[f][key])
                    stepped[key] = slot_state["step"]
            state.weights.copy_(self.flat["weights"], non_blocking=nb)
            state.grad_keys = grad_keys
            if grad_keys:
                state.grads = state.grads if state.grads is not None else layout.empty("cpu", self.pin)
                state.grads.copy_(self.flat["grads"], non_blocking=nb)
            else:
                state.grads = None
            if stepped:
                for f in _MOMENTS:
                    if getattr(state, f) is None:
                        setattr(state, f, layout.empty("cpu", self.pin))
                    getattr(state, f).copy_(self.flat[f], non_blocking=nb)
                state.step = stepped

    def close(self) -> None:
        """Drop every waiting candidate and the device slot (the base stays resident, clean)."""
        self.host.clear()
        self.live = None
        if SLOT in self.base.model.peft_config:  # absent when a rebuild failed half-way
            self.base.model.set_adapter(BOOT_ADAPTER)
            set_trainable(self.base.model, None)  # set_adapter made the boot adapter trainable
            self.base.model.delete_adapter(SLOT)
        self.slot_shape, self.slot_layout, self.slot_params, self.optimizer = None, None, {}, None
        self.flat, self.views = {}, {}

    def _live_or_host_weights(self, name: str) -> dict[str, torch.Tensor]:
        if self.live == name:
            return {k: p.detach() for k, p in self.slot_params.items()}
        self._sync()
        state = self.host[name]
        return state.layout.views(state.weights)

    def save(self, name: str, out_dir: Path) -> Path:
        self._check(name)
        return write_adapter(self._live_or_host_weights(name), self.host[name].candidate, self.base, out_dir)

    def snapshot(self, name: str) -> dict[str, torch.Tensor]:
        self._check(name)
        if self.live == name:
            assert self.optimizer is not None
            return snapshot_state(self.slot_params, self.optimizer)
        self._sync()
        state = self.host[name]
        out = {f"weight/{k}": v.clone() for k, v in state.layout.views(state.weights).items()}
        if state.exp_avg is not None and state.exp_avg_sq is not None:
            m, v = state.layout.views(state.exp_avg), state.layout.views(state.exp_avg_sq)
            for k in state.step:
                out[f"exp_avg/{k}"], out[f"exp_avg_sq/{k}"] = m[k].clone(), v[k].clone()
                out[f"step/{k}"] = state.step[k].clone()
        return out

    def _check(self, name: str) -> None:
        if name not in self.host:
            raise AdapterStoreError(f"unknown candidate {name!r}; the store holds {sorted(self.host)}")


def _adopted(tensor: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` holding ``tensor``'s values (a no-op when ``tensor`` already is ``view``'s memory)."""
    if tensor.data_ptr() != view.data_ptr():
        view.copy_(tensor)
    return view
