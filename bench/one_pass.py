"""Update time of K candidates: one forward/backward each (``sequential``) vs all in one pass (``one_pass``).

Three variants run in one process on the same base, the same K candidates
and the same rows, alternating, each with its own copies of the candidates in
one offload store (the round's default): ``sequential_whole`` (sequential with
``ResidentBase.share_prompts = False``: every row's prompt runs again, the
update before :mod:`trainer.model.logprobs`), ``sequential`` and ``one_pass``
(both running each distinct prompt of a pass once). A timed step is what a
round does for the K candidates of one step:

- ``sequential``: per candidate ``store.activate`` (the swap) and
  :func:`trainer.algorithms.update.update_step` (adapters-off reference forward, policy
  forward + backward, clip, AdamW);
- ``one_pass``: :func:`trainer.multi_lora.one_pass.train_one_pass` (pull every
  candidate's weights and AdamW state out of the store, then per chunk of at
  most ``--chunk-tokens`` padded tokens (``rl.update.chunk_tokens``, rows
  of all candidates mixed) one reference pass and one forward/backward, each
  row through its own candidate's LoRA weights, gradients accumulating; K
  AdamW steps, push back).

Both stores take the same number of steps on the same batches, so at the
end their weights must agree; the script prints the largest difference
(float32: ~1e-6; a bf16 base: larger, the passes group rows differently;
AdamW's first steps move every weight by about the learning rate whatever the
gradient's size, so this is a sanity check: the tests are the proof).

The base is either a packaged or local model (``--model``) or a randomly
initialised Llama of a published shape (``--shape smollm2`` / ``1b``, see
``bench/adapter_swap.py``; only a tokenizer is needed). Prints, per mode,
the median time of one step of all K candidates, the ratios against whole
rows, and as the last line the ratio sequential / one-pass, both sharing
prompts (> 1: one pass is faster).

    python bench/one_pass.py --device cpu --quick                  # seconds, a check that it runs
    python bench/one_pass.py --model smollm2-135m-instruct --k 8   # real weights, dtype auto
    python bench/one_pass.py --shape 1b --device cuda --k 8 --batch 16 --prompt-len 256 --completion-len 256
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import writer  # noqa: E402
from trainer.adapters.store import AdapterStore  # noqa: E402
from trainer.adapters.store import make_store
from trainer.model.base import ResidentBase  # noqa: E402
from trainer.config import CandidateConfig, RLConfig, UpdateConfig  # noqa: E402
from trainer.algorithms.batch import Batch  # noqa: E402
from trainer.algorithms.update import update_step

# variant -> (rl.update.mode, ResidentBase.share_prompts); "sequential_whole" is the update before prompt sharing
MODES = {"sequential_whole": ("sequential", False), "sequential": ("sequential", True), "one_pass": ("one_pass", True)}


def make_batches(
    base: ResidentBase, prompts: Sequence[Sequence[int]], k: int, group: int, completion_len: int, seed: int = 0
) -> list[Batch]:
    """One batch per candidate: every prompt ``group`` times with random completions of ``completion_len``
    tokens, behaviour log-probs = the base's own (PPO ratio 1 at the first step, as for on-policy
    rollouts), advantages alternating +-1: what a GRPO step of these sizes costs."""
    g = torch.Generator().manual_seed(seed)
    rows = [list(p) for p in prompts for _ in range(group)]
    out = []
    for _ in range(k):
        completions = torch.randint(10, len(base.tokenizer), (len(rows), completion_len), generator=g).tolist()
        with torch.no_grad(), base.reference():
            behaviour_BT, _ = base.completion_logprobs(rows, completions)
        adv = [1.0 if b % 2 else -1.0 for b in range(len(rows))]
        out.append(
            Batch(
                rows,
                completions,
                behaviour_BT.float().tolist(),
                adv,
                [float(b % 2) for b in range(len(rows))],
                ["bench"] * len(rows),
            )
        )
    return out


def _sync(base: ResidentBase) -> None:
    if base.device.type == "cuda":
        torch.cuda.synchronize(base.device)


def _step(
    variant: str,
    base: ResidentBase,
    store: AdapterStore,
    candidates: Sequence[CandidateConfig],
    batches: Sequence[Batch],
    rl: RLConfig,
) -> float:
    """Seconds of one step of all candidates in ``variant`` (a key of :data:`MODES`)."""
    from trainer.multi_lora.one_pass import train_one_pass

    mode, base.share_prompts = MODES[variant]
    _sync(base)
    started = time.perf_counter()
    try:
        if mode == "sequential":
            for c, b in zip(candidates, batches):
                update_step(base, store.activate(c.name), c, rl, b)
        else:
            train_one_pass(base, store, list(zip(candidates, batches)), rl)
        _sync(base)
    finally:
        base.share_prompts = True
    return time.perf_counter() - started


def compare_modes(
    base: ResidentBase, candidates: Sequence[CandidateConfig], batches: Sequence[Batch], rl: RLConfig, repeats: int
) -> dict[str, float]:
    """Median seconds per step of all K candidates in each variant of :data:`MODES` (one warm-up step
    each, then ``repeats`` alternating timed steps), and ``max_weight_diff``: the largest |difference|
    between any variant's LoRA weights and the whole-row sequential one's after the same steps."""
    store = make_store("offload", base, rl.seed)  # one store (one device slot) holds every variant's copies
    own = {m: [c.model_copy(update={"name": f"{m}-{c.name}"}) for c in candidates] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:  # the same start weights in every variant
        for first, *others in zip(*own.values()):
            store.create(first.name, first)
            for o in others:
                store.create(o.name, o, store.save(first.name, Path(tmp) / first.name))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for r in range(repeats + 1):
            for variant in MODES:
                seconds = _step(variant, base, store, own[variant], batches, rl)
                if r > 0:  # step 0 is the warm-up (AdamW state allocated, kernels chosen)
                    times[variant].append(seconds)
        diff = 0.0
        for first, *others in zip(*own.values()):
            a = store.snapshot(first.name)
            for o in others:
                b = store.snapshot(o.name)
                diff = max([diff, *(float((a[k].float() - b[k].float()).abs().max()) for k in a if ".lora_" in k)])
    finally:
        for name in list(store.names()):
            store.delete(name)
        store.close()
    return {**{m: statistics.median(t) for m, t in times.items()}, "max_weight_diff": diff}


def report(result: dict[str, float], k: int) -> list[str]:
    """The printed lines (the ratio of the two modes, both sharing prompts, last)."""
    whole, seq, one = result["sequential_whole"], result["sequential"], result["one_pass"]
    return [
        f"update step of {k} candidates (median): sequential, whole rows (before prompt sharing) {whole:.3f} s; "
        f"sequential {seq:.3f} s; one_pass {one:.3f} s; max |weight difference| after the same steps "
        f"{result['max_weight_diff']:.2e}",
        f"prompt sharing alone (sequential whole rows / sequential): {whole / seq:.2f}x; "
        f"sequential whole rows / one-pass: {whole / one:.2f}x",
        f"update time sequential / one-pass at K={k} (both sharing prompts): {seq / one:.2f}x",
    ]


COLUMNS = ["update mode", "median step of all K candidates", "time / one pass"]


def table_rows(result: dict[str, float]) -> list[list[str]]:
    """The rows of the benchmark page: each mode's median step and its ratio to one pass."""
    whole, seq, one = result["sequential_whole"], result["sequential"], result["one_pass"]
    return [
        ["`sequential`, whole rows (before prompt sharing)", f"{whole:.3f} s", f"{whole / one:.2f}x"],
        ["`sequential`", f"{seq:.3f} s", f"**{seq / one:.2f}x**"],
        ["`one_pass`", f"{one:.3f} s", "1.00x"],
    ]


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far, GiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def bench_candidates(k: int, rank: int, targets: Sequence[str] | None = None) -> list[CandidateConfig]:
    """K rank-``rank`` candidates with learning rates 1e-4 .. 4e-4 (cycling)."""
    extra: dict[str, Any] = {"target_modules": list(targets)} if targets else {}
    return [
        CandidateConfig(name=f"c{i}", lora_rank=rank, lora_alpha=2 * rank, learning_rate=1e-4 * (1 + i % 4), **extra)
        for i in range(k)
    ]


def main() -> None:
    from bench.adapter_swap import ALL_LINEAR, DTYPES, SHAPES, random_base
    from trainer.model import store as model_store
    from trainer.model.base import load_base, pick_device, pick_dtype
    from trainer.config import ModelConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=None, help="packaged model key or folder (real weights); default: a random --shape"
    )
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default="smollm2", help="random-weight Llama shape when --model is not given"
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder for --shape (default: SmolLM2's)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument(
        "--dtype", choices=["auto", *sorted(DTYPES)], default="auto", help="base dtype (auto: model.dtype's rule)"
    )
    ap.add_argument("--k", type=int, default=8, help="candidates")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default=None, help="comma-separated target modules (default: the candidates' default)")
    ap.add_argument("--batch", type=int, default=8, help="rows per candidate (prompts x G)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--completion-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per mode")
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=RLConfig().update.chunk_tokens,
        help="one_pass: padded tokens per forward/backward (rl.update.chunk_tokens)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="tiny sizes: K=2, 2 rows of 8 + 8 tokens, 1 repeat, tiny shape"
    )
    writer.add_arguments(ap)
    args = ap.parse_args()
    recorder = writer.Recorder("one-pass", args)
    if args.quick:
        args.k, args.batch, args.prompt_len, args.completion_len, args.repeats = 2, 2, 8, 8, 1
        args.shape = "tiny" if args.model is None else args.shape

    device = pick_device(args.device)
    if args.model is not None:
        base = load_base(
            ModelConfig(name=args.model, dtype=args.dtype, device="cuda" if device.type == "cuda" else "cpu")
        )
        label = str(args.model)
    else:
        tokenizer = args.tokenizer or model_store.resolve("smollm2-135m-instruct", ModelConfig().cache_dir)
        base = random_base(args.shape, tokenizer, device, pick_dtype(args.dtype, device))
        label = f"random {args.shape}"
    dtype = next(base.model.parameters()).dtype
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    targets = ALL_LINEAR if args.targets == "all" else (args.targets.split(",") if args.targets else None)
    candidates = bench_candidates(args.k, args.rank, targets)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, len(base.tokenizer), (1, args.prompt_len), generator=g).tolist()
    batches = make_batches(base, prompts, args.k, args.batch, args.completion_len)
    print(
        f"base {label} ({dtype}) on {name}; K={args.k} rank {args.rank}; {args.batch} rows x ({args.prompt_len} + {args.completion_len}) "
        f"tokens per candidate; {args.repeats} timed steps per mode; one_pass chunks of <= {args.chunk_tokens} tokens"
    )
    rl = RLConfig(update=UpdateConfig(adapters_per_pass=args.k, chunk_tokens=args.chunk_tokens))
    result = compare_modes(base, candidates, batches, rl, args.repeats)
    lines = report(result, args.k)
    shape = Path(args.model).name if args.model is not None else args.shape
    recorder.write(
        f"{shape}-{device.type}" + ("-quick" if args.quick else ""),
        title=f"{label}, {dtype} base on {name}: K = {args.k} rank-{args.rank} candidates, {args.batch} rows of "
        f"{args.prompt_len} + {args.completion_len} tokens each, chunks of <= {args.chunk_tokens} tokens",
        columns=COLUMNS,
        rows=table_rows(result),
        result=lines[-1],
        notes=[
            f"median of {args.repeats} timed steps per mode, alternating",
            f"max |weight difference| after the same steps: {result['max_weight_diff']:.2e}",
            f"peak RSS of the whole process (base, every mode's candidates, batches): {peak_rss_gib():.2f} GiB",
        ],
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
