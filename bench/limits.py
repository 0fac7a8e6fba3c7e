"""This machine's limits, measured by the benchmark itself, and the arithmetic that puts a phase's rate next to them.

Two limits bound what a round can do:

- **decode** reads every weight once per step (plus each active LoRA adapter), so
  ``tokens/s <= sequences in flight x bandwidth / weight bytes per step`` (:func:`decode_bound_tok_s`),
  and it computes ``2 x weights`` FLOPs per token, as prefill does per prompt token; the engine phase
  takes at least the larger of the two times (:func:`engine_bound`). On this 2-core host with 64 or
  more sequences in flight the compute time is the larger by ~10x, so the bandwidth bound alone
  overstates what decode can reach. KV-cache reads, attention and the sampler are left out (small
  for short completions), so the bound is optimistic.
- **training** is compute-bound: a forward pass costs ``2 x (linear weights) x (tokens)`` FLOPs plus
  ``2 x hidden x vocab`` per position whose logits are kept (:func:`forward_flops`; attention
  scores are left out: the sequences here are ~50 tokens); a backward pass with the base frozen
  costs the same again (gradients of the activations; the LoRA weights' own are negligible), so a
  training step is ``2 x`` its forward (:func:`train_flops`).

:func:`measure` times a large tensor copy (bandwidth: bytes read + written per second) and square
matmuls in bfloat16 and float32 (FLOP/s), best of a few tries, with torch's threads; it takes a few
seconds. :func:`rate_line` prints an achieved rate as a fraction of its bound. Used by
``bench/multilora.py``; another benchmark imports :func:`measure`, :class:`ModelShape` and the
bound functions the same way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes, as a Llama-style ``config.json`` gives them."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a Hugging Face ``config.json`` (dict) of a Llama-style model."""
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` features of each linear module of one layer, by its Llama name."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def layer_linear_params(self) -> int:
        """Weights of the linear modules of all layers (what every token's forward multiplies by)."""
        return self.layers * sum(a * b for a, b in self.module_shapes().values())

    @property
    def params(self) -> int:
        """All weights, the embedding once when tied to the LM head (norms left out: < 0.1 %)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layer_linear_params + embeddings

    def lora_params(self, rank: int, targets: tuple[str, ...] | list[str]) -> int:
        """Weights of one LoRA adapter of ``rank`` on ``targets`` (A: r x in, B: out x r, every layer)."""
        shapes = self.module_shapes()
        return self.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


def decode_bound_tok_s(weight_bytes_per_step: float, bandwidth_B_s: float, in_flight: int) -> float:
    """Highest decode rate: ``in_flight`` sequences gain a token per step, a step reads ``weight_bytes_per_step``."""
    return in_flight * bandwidth_B_s / weight_bytes_per_step


@dataclass(frozen=True)
class EngineBound:
    """The least time an inference engine needs for a phase, by each limit: ``compute_s`` (every prompt token
    prefilled once and every generated token decoded, :func:`forward_flops`, at the matmul rate) and
    ``reads_s`` (every decode step reads the weights once, at the memory bandwidth). The two overlap at best,
    so the phase takes at least the larger; ``binding`` names it."""

    compute_s: float
    reads_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.reads_s)

    @property
    def binding(self) -> str:
        return "compute" if self.compute_s >= self.reads_s else "memory bandwidth"


def engine_bound(
    shape: ModelShape,
    *,
    prefill_tokens: float,
    decode_tokens: float,
    in_flight: int,
    weight_bytes_per_step: float,
    bandwidth_B_s: float,
    flop_s: float,
) -> EngineBound:
    """:class:`EngineBound` of generating ``decode_tokens`` tokens after prefilling ``prefill_tokens``, with
    ``in_flight`` sequences decoding together. On a few CPU cores a batch of dozens of sequences is
    compute-bound: 64 sequences of a 135M model cost ~14 GFLOP a step, against ~0.5 GB of weight reads."""
    flops = forward_flops(shape, prefill_tokens + decode_tokens, decode_tokens)
    reads_tok_s = decode_bound_tok_s(weight_bytes_per_step, bandwidth_B_s, max(1, in_flight))
    return EngineBound(compute_s=flops / flop_s, reads_s=decode_tokens / reads_tok_s)


def forward_flops(shape: ModelShape, tokens: float, logit_positions: float) -> float:
    """FLOPs of a forward pass over ``tokens`` tokens that keeps the logits of ``logit_positions`` positions."""
    return 2.0 * shape.layer_linear_params * tokens + 2.0 * shape.hidden * shape.vocab * logit_positions


def train_flops(shape: ModelShape, tokens: float, logit_positions: float) -> float:
    """FLOPs of forward + backward with the base frozen (activation gradients only): twice the forward."""
    return 2.0 * forward_flops(shape, tokens, logit_positions)


@dataclass(frozen=True)
class Limits:
    """What :func:`measure` found: copy bandwidth (bytes/s) and matmul rates (FLOP/s) by dtype."""

    bandwidth_B_s: float
    matmul_flop_s: dict[str, float]
    threads: int

    def line(self) -> str:
        rates = ", ".join(f"{d} matmul {r / 1e9:.1f} GFLOP/s" for d, r in self.matmul_flop_s.items())
        return (
            f"measured limits ({self.threads} threads): memory bandwidth {self.bandwidth_B_s / 1e9:.1f} GB/s; {rates}"
        )


def rate_line(label: str, achieved: float, bound: float, unit: str, how: str = "") -> str:
    """``label: 123 tok/s = 4.5 % of the bound 2,733 tok/s (how)``."""
    share = achieved / bound if bound > 0 else float("nan")
    tail = f" ({how})" if how else ""
    return f"{label}: {achieved:,.1f} {unit} = {share:.1%} of the bound {bound:,.0f} {unit}{tail}"


def measure(copy_mib: int = 512, matmul_n: int = 1024, repeats: int = 5) -> Limits:
    """Time a ``copy_mib`` MiB tensor copy and ``matmul_n``-square matmuls (bf16, fp32); best of ``repeats``."""
    import torch

    n_floats = copy_mib * 2**20 // 4
    src, dst = torch.ones(n_floats), torch.empty(n_floats)
    dst.copy_(src)  # touch the pages first
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    bandwidth = 2 * src.numel() * 4 / best  # read + write
    del src, dst
    rates = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        a, b = torch.randn(matmul_n, matmul_n, dtype=dtype), torch.randn(matmul_n, matmul_n, dtype=dtype)
        a @ b  # warm up (kernel selection, oneDNN primitive cache)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - started)
        rates[name] = 2.0 * matmul_n**3 / best
    return Limits(bandwidth_B_s=bandwidth, matmul_flop_s=rates, threads=torch.get_num_threads())


if __name__ == "__main__":
    print(measure().line())
