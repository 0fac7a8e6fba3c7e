"""The reward model as an adapter on the resident base vs a separate reward model, side by side in one run.

(a) adapter: the process holds the resident policy base (as a round does) with
    a policy candidate and the reward model as LoRA adapters in one offload
    adapter store, plus the reward model's fp32 scalar head
    (:mod:`trainer.reward_model.model`). Scoring activates the reward adapter.
(b) separate: the process holds the same resident policy base (the policy
    still needs it) and a second full copy of the base as a reward model with
    its own head (``AutoModelForSequenceClassification``, ``num_labels=1``, the
    usual TRL reward-model setup).

Each variant runs in its own fresh Python process. Both score the same
rollouts (seeded chat prompts + seeded random completion tokens) in batches of
``--batch-size``: one warm-up pass over all of them, then the median of
``--repeats`` timed passes. Memory is the process's peak RSS
(``ru_maxrss``, Linux) minus its RSS after imports, so it counts the models,
adapters, heads and scoring activations; on CUDA also
``torch.cuda.max_memory_allocated``. Prints both rows and, last, the ratios
separate / adapter.

    python bench/reward_model.py --model tiny         # quick (a tiny random Llama)
    python bench/reward_model.py                      # SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import writer  # noqa: E402

MODEL_CACHE = Path(os.environ.get("HOURGLASS_MODEL_CACHE", "~/.cache/hourglass/models")).expanduser()


def model_path(name: str) -> Path:
    """``smollm2`` (packaged SmolLM2-135M-Instruct), ``tiny`` (a tiny random Llama with its tokenizer), or a folder."""
    from trainer.model import store as model_store

    if name == "smollm2":
        return model_store.resolve("smollm2-135m-instruct", MODEL_CACHE)
    if name == "tiny":
        smollm2 = model_store.resolve("smollm2-135m-instruct", MODEL_CACHE)
        return model_store.build_tiny_llama(MODEL_CACHE / "tiny-random-llama", tokenizer_from=smollm2).path
    return Path(name)


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def rollouts(tokenizer, n: int, completion_tokens: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` (prompt ids, completion ids): chat prompts of arithmetic questions, random completion tokens (seeded)."""
    import random

    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    prompts, completions = [], []
    for i in range(n):
        messages = [
            {
                "role": "user",
                "content": f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}? Answer with the number only.",
            }
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        completions.append([rng.choice(vocab) for _ in range(completion_tokens)])
    return prompts, completions


def run_variant(
    variant: str,
    path: Path,
    n: int,
    completion_tokens: int,
    batch_size: int,
    device: Literal["auto", "cpu", "cuda"],
    repeats: int = 3,
) -> dict:
    """One variant in this process; returns its measurements."""
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    from trainer.adapters.store import make_store
    from trainer.model.base import load_base, pick_device
    from trainer.config import CandidateConfig, ModelConfig, RewardModelConfig
    from trainer.reward_model.model import create_reward_model

    rss0 = _rss_bytes()
    dev = pick_device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    base = load_base(ModelConfig(name=str(path), device=device))  # the resident policy base, in both variants
    store = make_store("offload", base)
    store.create("policy", CandidateConfig(name="policy", start="fresh"))
    store.activate("policy")
    prompts, completions = rollouts(base.tokenizer, n, completion_tokens, seed=0)
    if variant == "adapter":
        rm = create_reward_model(base, store, RewardModelConfig(batch_size=batch_size), None)
        score = lambda p, c: rm.score(p, c)  # noqa: E731
    else:
        from transformers import AutoModelForSequenceClassification

        second = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=next(base.model.parameters()).dtype
        ).to(dev)
        second.config.pad_token_id = base.tokenizer.pad_token_id
        second.eval()

        @torch.no_grad()
        def score(p: list[list[int]], c: list[list[int]]) -> list[float]:
            out: list[float] = []
            for i in range(0, len(p), batch_size):
                seqs = [a + b for a, b in zip(p[i : i + batch_size], c[i : i + batch_size])]
                L = max(len(s) for s in seqs)
                input_BL = torch.full((len(seqs), L), base.tokenizer.pad_token_id, dtype=torch.long)
                attn_BL = torch.zeros_like(input_BL)
                for b, s in enumerate(seqs):  # right padding: the head reads the last non-pad token
                    input_BL[b, : len(s)] = torch.tensor(s)
                    attn_BL[b, : len(s)] = 1
                out += second(input_ids=input_BL.to(dev), attention_mask=attn_BL.to(dev)).logits[:, 0].float().tolist()
            return out

    score(prompts, completions)  # warm-up pass
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        started = time.perf_counter()
        scores = score(prompts, completions)
        if variant == "adapter":
            store.activate("policy")  # back to the policy, as a round does after scoring: the swap is part of the cost
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - started)
    elapsed = sorted(times)[len(times) // 2]
    out = {
        "variant": variant,
        "device": str(dev),
        "rollouts": len(scores),
        "score_s": elapsed,
        "peak_rss_delta_mib": (_peak_rss_bytes() - rss0) / 2**20,
    }
    if dev.type == "cuda":
        out["cuda_peak_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny | a model folder")
    parser.add_argument("--rollouts", type=int, default=256, help="rollouts to score")
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3, help="timed scoring passes (the median is reported)")
    parser.add_argument("--variant", choices=["adapter", "separate"], help=argparse.SUPPRESS)  # internal: one variant
    writer.add_arguments(parser)
    args = parser.parse_args()
    path = model_path(args.model)
    if args.variant:
        print(
            json.dumps(
                run_variant(
                    args.variant,
                    path,
                    args.rollouts,
                    args.completion_tokens,
                    args.batch_size,
                    args.device,
                    args.repeats,
                )
            )
        )
        return
    recorder = writer.Recorder("reward-model", args)
    rows = {}
    for variant in ("adapter", "separate"):
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            variant,
            "--model",
            str(path),
            "--rollouts",
            str(args.rollouts),
            "--completion-tokens",
            str(args.completion_tokens),
            "--batch-size",
            str(args.batch_size),
            "--device",
            args.device,
            "--repeats",
            str(args.repeats),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"variant {variant} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"model {path.name}, {args.rollouts} rollouts of {args.completion_tokens} tokens, batch {args.batch_size}, device {rows['adapter']['device']}"
    )
    cuda = "cuda_peak_mib" in rows["adapter"]
    print(
        f"{'variant':<10} {'peak RSS delta MiB':>19} {'median score s':>15} {'rollouts/s':>11}"
        + (f" {'CUDA peak MiB':>14}" if cuda else "")
    )
    for variant, r in rows.items():
        line = f"{variant:<10} {r['peak_rss_delta_mib']:>19.1f} {r['score_s']:>15.3f} {r['rollouts'] / r['score_s']:>11.1f}"
        print(line + (f" {r['cuda_peak_mib']:>14.1f}" if cuda else ""))
    a, s = rows["adapter"], rows["separate"]
    ratios = f"separate / adapter: peak RSS delta x{s['peak_rss_delta_mib'] / max(a['peak_rss_delta_mib'], 1e-9):.2f}, score time x{s['score_s'] / a['score_s']:.2f}"
    if cuda:
        ratios += f", CUDA peak x{s['cuda_peak_mib'] / max(a['cuda_peak_mib'], 1e-9):.2f}"
    recorder.write(
        f"{path.name}-{a['device']}",
        title=f"{path.name}, {args.rollouts} rollouts of {args.completion_tokens} tokens, batch {args.batch_size}, "
        f"device {a['device']}",
        columns=["variant", "peak RSS delta", "median score time", "rollouts/s"] + (["CUDA peak"] if cuda else []),
        rows=[
            [
                "adapter on the resident base" if variant == "adapter" else "separate copy of the base",
                f"{r['peak_rss_delta_mib']:.1f} MiB",
                f"{r['score_s']:.3f} s",
                f"{r['rollouts'] / r['score_s']:.1f}",
            ]
            + ([f"{r['cuda_peak_mib']:.1f} MiB"] if cuda else [])
            for variant, r in rows.items()
        ],
        result=ratios,
        notes=["each variant in its own process; RSS delta over the post-import RSS"],
    )
    print(ratios)


if __name__ == "__main__":
    main()
