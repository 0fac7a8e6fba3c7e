"""Adapter swap cost: K candidates trained in turn on one resident base, their
LoRA state kept on the device (``resident`` store) vs in host memory between
turns (``offload`` store, one device slot).

Both stores run in one process on the same base, the same candidates and the
same batches, alternating (resident, offload, resident, offload, ...). Each
training step is the real :func:`trainer.algorithms.update.update_step` (reference
forward for the KL, policy forward + backward, clip, AdamW) on a synthetic
batch of random token ids, preceded by the store's ``activate`` (the swap).
The base is randomly initialised in the shape asked for, so no weights are
needed (only a tokenizer).

Prints, per store: median swap, update and step time per candidate turn, the
swap share of the update, device memory above the base held between steps
and at peak (CUDA only) and host memory holding waiting candidates; then the
offload/resident ratios, and
as the last line the offload/resident step-time ratio (1.00 = swapping is
free).

    python bench/adapter_swap.py                                 # tiny shape, CPU
    python bench/adapter_swap.py --shape 1b --device cuda --dtype bfloat16 --batch 16 --prompt-len 256 --completion-len 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from bench import writer  # noqa: E402

from trainer.model import store as model_store  # noqa: E402
from trainer.adapters.store import make_store  # noqa: E402
from trainer.adapters.offload import OffloadStore  # noqa: E402
from trainer.model.base import ResidentBase, pick_device, wrap_base  # noqa: E402
from trainer.config import CandidateConfig, ModelConfig, RLConfig  # noqa: E402
from trainer.algorithms.batch import Batch  # noqa: E402
from trainer.algorithms.update import update_step

# Llama-family shapes: (hidden, intermediate, layers, heads, kv heads). The
# vocabulary is the tokenizer's. smollm2 = SmolLM2-135M, 1b = Llama-3.2-1B,
# 8b = Llama-3-8B (their published configs).
SHAPES = {
    "tiny": (64, 128, 2, 2, 2),
    "smollm2": (576, 1536, 30, 9, 3),
    "1b": (2048, 8192, 16, 32, 8),
    "8b": (4096, 14336, 32, 32, 8),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_base(shape: str, tokenizer_dir: Path, device: torch.device, dtype: torch.dtype) -> ResidentBase:
    """A randomly initialised Llama of ``shape``, built directly on ``device``."""
    hidden, inter, layers, heads, kv = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return wrap_base(model, tokenizer, tokenizer_dir, f"random:{shape}", max_seq_len=8192)


def synthetic_batch(B: int, prompt_len: int, completion_len: int, vocab: int, seed: int) -> Batch:
    """B random sequences, behaviour log-probs of -2 per token, advantages alternating +-1."""
    g = torch.Generator().manual_seed(seed)
    return Batch(
        prompt_ids=torch.randint(10, vocab, (B, prompt_len), generator=g).tolist(),
        completion_ids=torch.randint(10, vocab, (B, completion_len), generator=g).tolist(),
        behaviour_logprobs=[[-2.0] * completion_len for _ in range(B)],
        advantages=[1.0 if b % 2 else -1.0 for b in range(B)],
        rewards=[float(b % 2) for b in range(B)],
        versions=["bench"] * B,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_store(
    kind: str, base: ResidentBase, candidates: list[CandidateConfig], batch: Batch, rounds: int
) -> dict[str, float]:
    """One warm-up round then ``rounds`` rounds of one step per candidate; medians per turn."""
    rl = RLConfig()
    device = base.device
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    store = make_store(kind, base)
    for c in candidates:
        store.create(c.name, c)
    swap_s, update_s, step_s = [], [], []
    for r in range(rounds + 1):
        for c in candidates:
            started = time.perf_counter()
            optimizer = store.activate(c.name)
            metrics = update_step(base, optimizer, c, rl, batch)  # ends in .item(): a CPU-GPU sync point
            if r > 0:  # round 0 is the warm-up (optimizer state allocated, kernels chosen)
                step_s.append(time.perf_counter() - started)
                swap_s.append(store.last_swap_s)
                update_s.append(metrics["train/update_s"])
    _sync(device)
    held: float
    peak: float
    if device.type == "cuda":  # what stays between steps (adapters + AdamW state) and the peak (+ activations)
        held, peak = torch.cuda.memory_allocated(device) - before, torch.cuda.max_memory_allocated(device) - before
    else:
        held = peak = float("nan")
    host = store.host_bytes() if isinstance(store, OffloadStore) else 0
    store.close()
    return {
        "swap_s": statistics.median(swap_s),
        "update_s": statistics.median(update_s),
        "step_s": statistics.median(step_s),
        "held_gib": held / 2**30,
        "peak_gib": peak / 2**30,
        "host_gib": host / 2**30,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--tokenizer", type=Path, default=None, help="folder with a tokenizer (default: SmolLM2's)")
    ap.add_argument("--candidates", type=int, default=8, help="K adapters trained in turn")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=",".join(ALL_LINEAR), help="comma-separated target modules")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (prompts x G)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--completion-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per store and repeat")
    ap.add_argument("--repeats", type=int, default=2, help="alternating (resident, offload) repeats")
    writer.add_arguments(ap)
    args = ap.parse_args()
    recorder = writer.Recorder("adapter-swap", args)

    device = pick_device(args.device)
    tokenizer_dir = args.tokenizer or model_store.resolve("smollm2-135m-instruct", ModelConfig().cache_dir)
    base = random_base(args.shape, tokenizer_dir, device, DTYPES[args.dtype])
    n_base = sum(p.numel() for p in base.model.parameters())
    targets = args.targets.split(",")
    candidates = [
        CandidateConfig(
            name=f"cand-{i}", lora_rank=args.rank, lora_alpha=2 * args.rank, learning_rate=1e-4, target_modules=targets
        )
        for i in range(args.candidates)
    ]
    batch = synthetic_batch(args.batch, args.prompt_len, args.completion_len, len(base.tokenizer), seed=0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    print(
        f"base {args.shape} ({n_base / 1e6:.1f} M params, {args.dtype}) on {name}; K={args.candidates} rank {args.rank} "
        f"on {len(targets)} module types; batch {args.batch} x ({args.prompt_len} + {args.completion_len}) tokens"
    )

    results: dict[str, list[dict[str, float]]] = {"resident": [], "offload": []}
    for _ in range(args.repeats):
        for kind in ("resident", "offload"):
            results[kind].append(run_store(kind, base, candidates, batch, args.rounds))
    summary = {kind: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for kind, runs in results.items()}
    for kind, s in summary.items():
        device_mem = (
            f"  device: held {s['held_gib']:.3f} GiB, peak {s['peak_gib']:.2f} GiB above the base"
            if device.type == "cuda"
            else ""
        )
        print(
            f"{kind:>8}: swap {s['swap_s'] * 1e3:8.2f} ms  update {s['update_s'] * 1e3:9.1f} ms  step {s['step_s'] * 1e3:9.1f} ms  "
            f"swap/update {s['swap_s'] / s['update_s']:6.2%}{device_mem}  host {s['host_gib']:.3f} GiB"
        )
    res, off = summary["resident"], summary["offload"]
    notes = []
    if device.type == "cuda":
        held = f"device memory held between steps (adapters + AdamW state), offload / resident: {off['held_gib'] / res['held_gib']:.3f}"
        print(held)
        notes.append(held)
    last = f"step time, offload / resident: {off['step_s'] / res['step_s']:.3f}"
    columns = ["store", "swap", "update", "step", "swap / update", "host memory of waiting candidates"]
    if device.type == "cuda":
        columns += ["device memory held between steps", "device peak above the base"]
    recorder.write(
        f"{args.shape}-{device.type}",
        title=f"{args.shape} shape ({n_base / 1e6:.1f} M params, {args.dtype}) on {name}: K = {args.candidates} rank-{args.rank} "
        f"adapters on {len(targets)} module types, batch {args.batch} x ({args.prompt_len} + {args.completion_len}) tokens",
        columns=columns,
        rows=[
            [
                f"`{kind}`",
                f"{s['swap_s'] * 1e3:.2f} ms",
                f"{s['update_s'] * 1e3:.1f} ms",
                f"{s['step_s'] * 1e3:.1f} ms",
                f"{s['swap_s'] / s['update_s']:.2%}",
                f"{s['host_gib']:.3f} GiB",
            ]
            + ([f"{s['held_gib']:.3f} GiB", f"{s['peak_gib']:.2f} GiB"] if device.type == "cuda" else [])
            for kind, s in summary.items()
        ],
        result=last,
        notes=notes + [f"medians over {args.rounds} timed rounds x {args.repeats} alternating repeats per store"],
    )
    print(last)


if __name__ == "__main__":
    main()
