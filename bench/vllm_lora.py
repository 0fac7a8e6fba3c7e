"""vLLM CPU rollouts through LoRA adapters: upstream kernels vs Hourglass's grouped kernels.

Two vLLM servers, one after the other, on the same model, adapters and
requests; the only difference is ``HOURGLASS_VLLM_GROUPED_LORA`` (0 = vLLM's
reference per-token kernels, 1 = the grouped kernels of
``pipeline/serving/vllm_cpu_lora.py``). Each server gets the same rollout workload as a
training step (P prompts x G samples x T new tokens per adapter, all adapters'
requests in flight together, through ``VLLMEngine``), first from the bare base
model, then through the adapters. Prints seconds per workload and LoRA/base
overhead for both, and as the last line the speedup of LoRA rollouts.

With ``--compare dtype`` the two servers both run the grouped kernels and
differ in ``--dtype`` instead (float32, the CPU default, vs bfloat16); besides
the sampled workload each side answers the evaluation's greedy workload (every
adapter and the base on ``--eval-prompts`` prompts, n = 1), and the mean
absolute difference of the two sides' log-probs of the float32 side's greedy
tokens is printed (scored by the bf16 server as a prompt, ``prompt_logprobs``).

    python bench/vllm_lora.py                      # SmolLM2, 2 adapters
    python bench/vllm_lora.py --model tiny --adapters 4
    python bench/vllm_lora.py --compare dtype --adapters 8 --prompts 2 --group 4 --max-new-tokens 16
    python bench/vllm_lora.py --compare max-num-seqs --adapters 8 --eval-prompts 96   # a learn round's engine work

With ``--compare max-num-seqs`` the servers differ in ``--max-num-seqs`` (64, the setting before
``serving.max_num_seqs`` existed, vs 256, its default) and answer the same workloads as ``dtype``.
With ``--compare lora-form`` both run the grouped kernels, the first with one matmul per slot always
(``HOURGLASS_VLLM_LORA_STACKED_WORK=0``), the second with the stacked form for small batches (the default);
``--dtype`` sets both servers' dtype:

    python bench/vllm_lora.py --compare lora-form --adapters 8 --eval-prompts 96 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import writer  # noqa: E402
from pipeline.config import VLLM_MAX_NUM_SEQS_DEFAULT  # noqa: E402
from pipeline.stack import free_port, vllm_service  # noqa: E402
from trainer.model import store as model_store  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.types import RolloutRequest  # noqa: E402
from trainer.rollout.vllm import VLLMEngine  # noqa: E402
from pipeline.serving.vllm_cpu_lora import ENV_SWITCH, STACKED_ENV  # noqa: E402

# --compare SETTING: the two servers' settings (the first is the baseline), all else equal, grouped kernels
SETTINGS: dict[str, dict[str, dict[str, Any]]] = {
    "dtype": {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}},
    "max-num-seqs": {"64": {"max_num_seqs": 64}, "256": {"max_num_seqs": 256}},
    # the grouped kernels alone (one matmul per slot) vs with the stacked form for small batches (the default)
    "lora-form": {"grouped": {"env": {STACKED_ENV: "0"}}, "stacked": {"env": {}}},
}


def make_adapters(model_dir: Path, out: Path, k: int, rank: int) -> list[Path]:
    """K rank-``rank`` PEFT adapters on q/k/v/o with small random B (so they change outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = []
    for i in range(k):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        peft = get_peft_model(
            model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        )
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 1e-3)
        peft.save_pretrained(str(out / f"adapter-{i}"))
        folders.append(out / f"adapter-{i}")
    return folders


def prompts(model_dir: Path, count: int) -> list[tuple[int, ...]]:
    from transformers import AutoTokenizer

    from trainer.model.base import chat_token_ids
    from trainer.data import prompts_from_table, snapshot_table
    from trainer.tasks import reasoning_gym_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = prompts_from_table(
        snapshot_table(
            reasoning_gym_prompts(
                "basic_arithmetic", count, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1
            )
        )
    )
    return [tuple(chat_token_ids(tok, p.messages)) for p in rows]


def workload(
    engine: VLLMEngine, versions: list[str], ids: list[tuple[int, ...]], args: argparse.Namespace
) -> tuple[float, int]:
    """(seconds, generated tokens) for every version x prompt, n=G, sent at once."""
    reqs = [
        RolloutRequest(
            version=v, prompt_id=f"p{j}", prompt_token_ids=p, n=args.group, max_new_tokens=args.max_new_tokens
        )
        for v in versions
        for j, p in enumerate(ids)
    ]
    started = time.perf_counter()
    groups = engine.generate(reqs)
    return time.perf_counter() - started, sum(len(s.token_ids) for g in groups for s in g)


def greedy(engine: VLLMEngine, versions: list[str], ids: list[tuple[int, ...]], new_tokens: int) -> tuple[float, list]:
    """(seconds, samples) of the evaluation's workload: every version greedy on every prompt, sent at once."""
    reqs = [
        RolloutRequest(
            version=v, prompt_id=f"p{j}", prompt_token_ids=p, n=1, max_new_tokens=new_tokens, temperature=0.0
        )
        for v in versions
        for j, p in enumerate(ids)
    ]
    started = time.perf_counter()
    groups = engine.generate(reqs)
    return time.perf_counter() - started, [g[0] for g in groups]


def measure(
    grouped: bool,
    model_dir: Path,
    adapters: list[Path],
    ids,
    args,
    logs: Path,
    dtype: str = "auto",
    max_num_seqs: int = VLLM_MAX_NUM_SEQS_DEFAULT,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    service = vllm_service(
        model_dir,
        "127.0.0.1",
        free_port(),
        logs,
        max_model_len=512,
        max_lora_rank=16,
        max_loras=max(2, len(adapters)),
        dtype=dtype,
        max_num_seqs=max_num_seqs,
    )
    service.env[ENV_SWITCH] = "1" if grouped else "0"
    service.env.update(env or {})
    service.start()
    try:
        engine = VLLMEngine(f"http://127.0.0.1:{service.port}")
        versions = []
        for i, folder in enumerate(adapters):
            engine.load(f"a{i}", f"a{i}", folder)
            versions.append(f"a{i}")
        workload(engine, ["base"], ids[:1], args)  # warm-up
        workload(engine, versions, ids[:1], args)
        base_s = min(workload(engine, ["base"] * len(versions), ids, args)[0] for _ in range(args.repeats))
        lora_s = min(workload(engine, versions, ids, args)[0] for _ in range(args.repeats))
        out: dict[str, Any] = {"base_s": base_s, "lora_s": lora_s}
        if args.compare in SETTINGS:
            eval_ids = prompts(model_dir, args.eval_prompts)
            runs = [greedy(engine, ["base", *versions], eval_ids, args.max_new_tokens) for _ in range(args.repeats)]
            out["greedy_s"] = min(r[0] for r in runs)
            out["greedy_samples"] = runs[0][1]
        return out
    finally:
        service.stop()


def logprob_gap(samples_a: list, samples_b: list) -> tuple[float, float]:
    """(mean |logprob difference| over tokens both sides generated alike, fraction of answers that are equal)."""
    diffs, same = [], 0
    for a, b in zip(samples_a, samples_b):
        same += a.token_ids == b.token_ids
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if ta != tb:
                break
            diffs.append(abs(la - lb))
    return (sum(diffs) / len(diffs) if diffs else float("nan")), same / max(1, len(samples_a))


def compare_settings(
    args: argparse.Namespace, model_dir: Path, adapters: list[Path], ids, work: Path, recorder: writer.Recorder
) -> None:
    """Two servers that differ in one setting (``SETTINGS[args.compare]``), each timed on the sampled rollouts
    (bare base, through the adapters) and the greedy evaluation; prints and records base-setting / new-setting."""
    flag = "LoRA kernel form" if args.compare == "lora-form" else f"vLLM --{args.compare}"
    (old, old_kw), (new, new_kw) = SETTINGS[args.compare].items()
    sides = {
        label: measure(
            True, model_dir, adapters, ids, args, work / f"logs-{args.compare}-{label}", **{"dtype": args.dtype, **kw}
        )
        for label, kw in ((old, old_kw), (new, new_kw))
    }
    for label, r in sides.items():
        print(
            f"{flag} {label:>9}: base {r['base_s']:.2f} s, through {args.adapters} adapters {r['lora_s']:.2f} s, "
            f"greedy evaluation ({args.adapters + 1} versions x {args.eval_prompts} prompts) {r['greedy_s']:.2f} s"
        )
    gap, same = logprob_gap(sides[old]["greedy_samples"], sides[new]["greedy_samples"])
    a, b = sides[old], sides[new]
    print(f"greedy answers equal on both servers: {same:.1%}; mean |log-prob difference| on equal prefixes {gap:.4f}")
    last = (
        f"{flag} {new} vs {old}: LoRA rollouts {a['lora_s'] / b['lora_s']:.2f}x, "
        f"greedy evaluation {a['greedy_s'] / b['greedy_s']:.2f}x (> 1: {new} faster)"
    )
    dtype = "" if args.compare == "dtype" or args.dtype == "auto" else f"-{args.dtype}"
    recorder.write(
        f"{args.compare}-{model_dir.name}{dtype}",
        title=f"{flag} {old} vs {new}, {model_dir.name}{dtype.replace('-', ', vLLM --dtype ')}, "
        f"{args.adapters} rank-{args.rank} adapters, "
        f"grouped kernels; sampled: {args.prompts} prompts x G = {args.group} x {args.max_new_tokens} tokens per "
        f"adapter; greedy: {args.adapters + 1} versions x {args.eval_prompts} prompts",
        columns=["workload", old, new, f"{old} / {new}"],
        rows=[
            [label, f"{a[key]:.2f} s", f"{b[key]:.2f} s", f"{a[key] / b[key]:.2f}x"]
            for label, key in (
                ("bare base, sampled", "base_s"),
                (f"through the {args.adapters} adapters, sampled", "lora_s"),
                ("greedy evaluation", "greedy_s"),
            )
        ],
        result=last,
        notes=[
            f"greedy answers equal on both servers: {same:.1%}; mean |log-prob difference| on equal prefixes "
            f"{gap:.4f} nats",
            f"two servers one after the other, best of {args.repeats} per side",
        ],
    )
    print(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="packaged model key, 'tiny', or a folder")
    parser.add_argument("--adapters", type=int, default=2, help="adapters sampled together (K)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per adapter (P)")
    parser.add_argument("--group", type=int, default=6, help="samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats per side; the best is kept")
    parser.add_argument(
        "--compare",
        choices=["kernels", *SETTINGS],
        default="kernels",
        help="what differs between the two servers: the LoRA kernels, vLLM's --dtype, its --max-num-seqs, or the "
        "grouped kernels' form for small batches (lora-form)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="vLLM --dtype of both servers where --compare does not set it (auto: float32 on CPU, as the service)",
    )
    parser.add_argument(
        "--eval-prompts", type=int, default=32, help="--compare dtype / max-num-seqs: greedy evaluation prompts"
    )
    writer.add_arguments(parser)
    args = parser.parse_args()
    recorder = writer.Recorder("vllm-lora", args)
    cache = ModelConfig().cache_dir
    if args.model == "tiny":
        model_dir = model_store.build_tiny_llama(
            Path(cache).expanduser() / "tiny-random-llama",
            tokenizer_from=model_store.pull("smollm2-135m-instruct", cache).path,
        ).path
    elif args.model in model_store.KNOWN_MODELS:
        model_dir = model_store.pull(args.model, cache).path
    else:
        model_dir = Path(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-lora-"))
    adapters = make_adapters(model_dir, work, args.adapters, args.rank)
    ids = prompts(model_dir, args.prompts)
    print(
        f"model={model_dir.name} K={args.adapters} rank={args.rank} P={args.prompts} G={args.group} max_new_tokens={args.max_new_tokens} cores={len(os.sched_getaffinity(0))}"
    )
    if args.compare in SETTINGS:
        compare_settings(args, model_dir, adapters, ids, work, recorder)
        return
    results = {}
    for grouped in (False, True):
        label = "grouped (hourglass)" if grouped else "upstream per-token"
        r = measure(grouped, model_dir, adapters, ids, args, work / f"logs-{int(grouped)}")
        results[grouped] = r
        print(
            f"{label:>20}: base {r['base_s']:.2f} s, through {args.adapters} adapters {r['lora_s']:.2f} s, LoRA/base {r['lora_s'] / r['base_s']:.2f}x"
        )
    last = (
        f"LoRA rollout speedup grouped vs upstream kernels: {results[False]['lora_s'] / results[True]['lora_s']:.2f}x"
    )
    recorder.write(
        f"kernels-{model_dir.name}",
        title=f"upstream per-token vs grouped LoRA kernels, {model_dir.name}, {args.adapters} rank-{args.rank} "
        f"adapters, {args.prompts} prompts x G = {args.group} x {args.max_new_tokens} tokens per adapter",
        columns=["kernels", "bare base", f"through the {args.adapters} adapters", "LoRA / base"],
        rows=[
            [
                "grouped (Hourglass)" if grouped else "upstream per-token",
                f"{r['base_s']:.2f} s",
                f"{r['lora_s']:.2f} s",
                f"{r['lora_s'] / r['base_s']:.2f}x",
            ]
            for grouped, r in results.items()
        ],
        result=last,
        notes=[f"two servers one after the other, best of {args.repeats} per side"],
    )
    print(last)


if __name__ == "__main__":
    main()
