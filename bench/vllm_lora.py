"""vLLM CPU rollouts through LoRA adapters: upstream kernels vs Hourglass's grouped kernels.

Two vLLM servers, one after the other, on the same model, adapters and
requests; the only difference is ``HOURGLASS_VLLM_GROUPED_LORA`` (0 = vLLM's
reference per-token kernels, 1 = the grouped kernels of
``pipeline/serving/vllm_cpu_lora.py``). Each server gets the same rollout workload as a
training step (P prompts x G samples x T new tokens per adapter, all adapters'
requests in flight together, through ``VLLMEngine``), first from the bare base
model, then through the adapters. Prints seconds per workload and LoRA/base
overhead for both, and as the last line the speedup of LoRA rollouts.

    python bench/vllm_lora.py                      # SmolLM2, 2 adapters
    python bench/vllm_lora.py --model tiny --adapters 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline.stack import free_port, vllm_service  # noqa: E402
from trainer import model_store  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.rollout import RolloutRequest  # noqa: E402
from trainer.rollout_vllm import VLLMEngine  # noqa: E402
from pipeline.serving.vllm_cpu_lora import ENV_SWITCH  # noqa: E402


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

    from trainer.base import chat_token_ids
    from trainer.tasks import prompts_from_table, reasoning_gym_prompts, snapshot_table

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


def measure(grouped: bool, model_dir: Path, adapters: list[Path], ids, args, logs: Path) -> dict[str, float]:
    service = vllm_service(
        model_dir, "127.0.0.1", free_port(), logs, max_model_len=512, max_lora_rank=16, max_loras=max(2, len(adapters))
    )
    service.env[ENV_SWITCH] = "1" if grouped else "0"
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
    finally:
        service.stop()
    return {"base_s": base_s, "lora_s": lora_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="packaged model key, 'tiny', or a folder")
    parser.add_argument("--adapters", type=int, default=2, help="adapters sampled together (K)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per adapter (P)")
    parser.add_argument("--group", type=int, default=6, help="samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats per side; the best is kept")
    args = parser.parse_args()
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
    results = {}
    for grouped in (False, True):
        label = "grouped (hourglass)" if grouped else "upstream per-token"
        r = measure(grouped, model_dir, adapters, ids, args, work / f"logs-{int(grouped)}")
        results[grouped] = r
        print(
            f"{label:>20}: base {r['base_s']:.2f} s, through {args.adapters} adapters {r['lora_s']:.2f} s, LoRA/base {r['lora_s'] / r['base_s']:.2f}x"
        )
    print(
        f"LoRA rollout speedup grouped vs upstream kernels: {results[False]['lora_s'] / results[True]['lora_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
