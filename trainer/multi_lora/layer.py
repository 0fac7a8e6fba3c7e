"""A multi-adapter LoRA layer with per-row adapter indices: all candidates' rows through one forward/backward.

PEFT's LoRA layers apply one active adapter to a whole batch in training
(its ``adapter_names`` mixed batches are inference-only). :class:`MultiLoRA`
instead hooks the base's linear layers (the ``base_layer`` of each PEFT LoRA
layer, run with PEFT's adapters disabled) and adds, for a batch whose rows
``b`` carry adapter indices ``idx_B[b]``::

    y_b = W x_b + scale[idx_b] * B[idx_b] (A[idx_b] x_b)      (Hu et al. 2021, arXiv:2106.09685)

with ``A_k [r_k, in]``, ``B_k [out, r_k]``, ``scale_k = alpha_k / r_k`` (PEFT's
scaling, no rsLoRA). Rows are grouped by adapter (:func:`trainer.algorithms.chunks.plan_chunks`
hands them over grouped; other callers' rows are sorted once per batch) and
each group is one pair of matmuls:

- everywhere: a segmented loop, one ``F.linear`` pair per (module, adapter)
  group, each adapter at its own rank (no padding);
- on CUDA, when ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm``)
  exists: one grouped matmul pair per module over all groups, ranks padded to
  the module's largest rank (rounded up to a multiple of 8 for the kernels'
  16-byte stride rule) with zero columns of ``A^T`` / zero rows of
  ``scale * B^T`` (exact: the padded directions contribute 0 and get no
  update). The kernel runs in the LoRA weights' dtype (float32), which keeps
  the result equal to PEFT's; where a kernel takes bf16 only, or any other
  error comes from it (alignment, older GPU), that layer set falls back to
  the loop for good (logged). Its forward is tested against the loop on CPU;
  its CUDA backward has not been run by the tests.

An adapter that does not target a module contributes nothing there (its rows
get a zero delta), so candidates with different ranks and target modules mix.
LoRA weights stay float32 (the LoRA input is cast to their dtype and the sum
back to the base layer's output dtype, as PEFT does). Layers that read the
same input tensor (``q/k/v_proj``, ``gate/up_proj``) share one cast, which is
what backward keeps: PEFT keeps one float32 copy per LoRA layer.

The one-pass step that trains through these weights is :mod:`trainer.multi_lora.one_pass`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.errors import TrainerConfigError
from trainer.adapters.lora_tensors import lora_pairs

log = logging.getLogger(__name__)

_GROUPED = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@dataclass(frozen=True)
class _Lora:
    adapter: int
    A: torch.Tensor  # [r, in]
    B: torch.Tensor  # [out, r]
    scale: float


class MultiLoRA:
    """K adapters' LoRA weights on one base, applied per row (see the module docstring).

    Args:
        model: the PEFT-wrapped base (``ResidentBase.model``).
        adapters: per adapter ``k``: ``(scale_k, {PEFT saved key: tensor})`` with
            linear LoRA keys (``...<module>.lora_A.weight`` ``[r, in]`` and
            ``...lora_B.weight`` ``[out, r]``); the tensors are used as they are
            (parameters with grad train through them).
        grouped: use the grouped matmul kernel (default: on CUDA when torch has one).

    Raises:
        TrainerConfigError: an adapter has non-linear LoRA tensors (embeddings) or
            adapts a module the model does not have.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        adapters: Sequence[tuple[float, Mapping[str, torch.Tensor]]],
        grouped: bool | None = None,
    ) -> None:
        self.by_module: dict[str, dict[int, _Lora]] = {}
        for k, (scale, tensors) in enumerate(adapters):
            pairs = lora_pairs(tensors)
            if len(pairs) * 2 != len(tensors) or any(".lora_A." not in a for a, _ in pairs):
                raise TrainerConfigError(
                    f"adapter {k}: one-pass training supports linear LoRA layers only, got {sorted(tensors)[:3]}..."
                )
            for key_a, key_b in pairs:
                module = key_a.split(".lora_A.")[0]
                self.by_module.setdefault(module, {})[k] = _Lora(k, tensors[key_a], tensors[key_b], scale)
        self.K = len(adapters)
        self.grouped = grouped
        self._order: torch.Tensor | None = None  # row permutation that groups rows by adapter (None: already grouped)
        self._segments: list[tuple[int, int, int]] | None = None  # (adapter, first row, end row) in grouped order
        # the last layer input and its copy in the LoRA weights' dtype: q/k/v (and gate/up) projections read the
        # same tensor, so one cast (kept for backward) serves them all instead of one per module as in PEFT
        self._cast: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handles = []
        for name, entries in self.by_module.items():
            try:
                layer = model.get_submodule(name)
            except AttributeError as err:
                raise TrainerConfigError(f"LoRA module {name!r} is not in the model: {err}") from err
            layer = getattr(layer, "base_layer", layer)
            self._handles.append(layer.register_forward_hook(self._hook(entries)))

    def close(self) -> None:
        """Remove the hooks (the base is as before)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextlib.contextmanager
    def active(self, adapter_B: Sequence[int]) -> Iterator[None]:
        """Inside the block, row ``b`` of each forward goes through adapter ``adapter_B[b]``.

        Outside it the hooks add nothing. Run the forward with PEFT's adapters
        disabled (``base.reference()``) so only these weights apply.
        """
        idx = torch.as_tensor(list(adapter_B), dtype=torch.long)
        if idx.numel() and (idx.min() < 0 or idx.max() >= self.K):
            raise TrainerConfigError(f"adapter indices must lie in [0, {self.K}), got {sorted(set(idx.tolist()))}")
        grouped_already = bool((idx[1:] >= idx[:-1]).all()) if idx.numel() > 1 else True
        order = torch.arange(idx.numel()) if grouped_already else torch.sort(idx, stable=True).indices
        sorted_idx = idx[order]
        segments, start = [], 0
        for k, n in zip(*torch.unique_consecutive(sorted_idx, return_counts=True)):
            segments.append((int(k), start, start + int(n)))
            start += int(n)
        self._order, self._segments = (None if grouped_already else order), segments
        try:
            yield
        finally:
            self._order, self._segments, self._cast = None, None, None

    def _hook(self, entries: dict[int, _Lora]):
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if self._segments is None:
                return None
            x = args[0]
            rows = self._segments[-1][2] if self._segments else 0
            if x.shape[0] != rows:
                raise TrainerConfigError(
                    f"multi-adapter LoRA expects batch-first inputs with one row per sequence ({rows} rows); "
                    f"{type(module).__name__} got {tuple(x.shape)}: train this model with [rl.update] mode = 'sequential'"
                )
            order = self._order
            dtype = next(iter(entries.values())).A.dtype
            if self._cast is not None and self._cast[0] is x and self._cast[1].dtype == dtype:
                x = self._cast[1]
            else:
                source = x
                if order is not None:
                    x = x.index_select(0, order.to(x.device))
                x = x.to(dtype)
                self._cast = (source, x)
            delta = self._delta(x, entries, output.shape[-1])
            if order is not None:
                delta = delta.index_select(0, torch.argsort(order).to(delta.device))
            return (output + delta).to(output.dtype)  # as PEFT: base output + float32 LoRA term, back to the base dtype

        return hook

    def _delta(self, x: torch.Tensor, entries: dict[int, _Lora], out_features: int) -> torch.Tensor:
        """The LoRA term of rows ``x`` (grouped order, already in the LoRA weights' dtype)."""
        assert self._segments is not None
        use_grouped = self.grouped if self.grouped is not None else (x.is_cuda and _GROUPED is not None)
        if use_grouped and _GROUPED is not None:
            try:
                return self._delta_grouped(x, entries, out_features)
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
                log.warning("grouped matmul unavailable here (%s); using the segmented loop", err)
                self.grouped = False
        pieces = []
        for k, s, e in self._segments:
            lora = entries.get(k)
            xs = x[s:e]
            if lora is None:  # this adapter does not target the module
                pieces.append(xs.new_zeros((*xs.shape[:-1], out_features)))
            else:
                pieces.append(F.linear(F.linear(xs, lora.A), lora.B) * lora.scale)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def _delta_grouped(self, x: torch.Tensor, entries: dict[int, _Lora], out_features: int) -> torch.Tensor:
        """One grouped matmul pair over the row groups; ranks padded to the largest (zeros)."""
        assert self._segments is not None and _GROUPED is not None
        r_max = -(-max(lora.A.shape[0] for lora in entries.values()) // 8) * 8  # kernels need 16-byte aligned strides
        in_features = x.shape[-1]
        a_list, b_list = [], []
        for k, _, _ in self._segments:
            lora = entries.get(k)
            if lora is None:
                a_list.append(x.new_zeros((in_features, r_max)))
                b_list.append(x.new_zeros((r_max, out_features)))
            else:
                pad = r_max - lora.A.shape[0]
                a_list.append(F.pad(lora.A.t(), (0, pad)))
                b_list.append(F.pad(lora.B.t() * lora.scale, (0, 0, 0, pad)))
        per_row = x[0].numel() // in_features  # tokens per row
        offs = torch.tensor([e * per_row for _, _, e in self._segments], dtype=torch.int32, device=x.device)
        x2 = x.reshape(-1, in_features).contiguous()
        h = _GROUPED(x2, torch.stack(a_list), offs=offs)
        return _GROUPED(h, torch.stack(b_list), offs=offs).reshape(*x.shape[:-1], out_features)
