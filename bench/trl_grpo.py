"""One experiment the way a user would run it with Hugging Face TRL: ``GRPOTrainer`` + a PEFT ``LoraConfig``,
one process, no server (TRL's transformers-``generate`` path), then greedy evaluation.

Run by ``bench/multilora.py`` (the peer of its side-by-side), once per candidate, with the python of the
scratch venv ``bench/trl_env.py`` builds and ``PYTHONPATH`` at the checkout: it reads a spec JSON (the
candidate, the workload, the step-ordered training prompts and the held-out prompts, all drawn by the
parent with the round's own code) and writes a report JSON (phase times, learning figures).

:func:`grpo_settings` maps our round's recipe onto ``GRPOConfig``; every setting that can match does:

========================================  =====================================================
ours (``trainer/``)                        TRL 1.16 ``GRPOConfig``
========================================  =====================================================
base in bf16 (``model.dtype = auto``),     model loaded here in bf16 and handed to the trainer;
LoRA weights float32, no autocast          ``bf16=False`` (TRL's default ``True`` autocasts);
                                           PEFT's ``autocast_adapter_dtype`` keeps LoRA float32
LoRA r, alpha, q/k/v/o, no dropout         the same ``LoraConfig`` (``trainer.model.base.lora_config``)
start weights seeded by (name, seed)       the same tensors copied in (``trainer.adapters.lora_tensors``)
S steps x P prompts x G                    ``max_steps=S``, ``per_device_train_batch_size=P*G``,
                                           ``num_generations=G``, no accumulation
the round's prompts, drawn per step        dataset in that order, ``shuffle_dataset=False``
max new tokens, temperature 1              ``max_completion_length``, ``temperature``, top-p 1, top-k off
reward first_number_answer + 0.5 format    one reward function calling our ``RewardMix`` (same code)
PPO-clip epsilon 0.2                       ``epsilon=0.2`` (``loss_type="dapo"``: clipped surrogate)
token mean over the batch                  ``dapo``: sum over tokens / tokens of the batch (one process,
                                           no accumulation: our token mean)
k3 KL to the adapters-off base, beta       ``beta=kl_coef`` (TRL default 0: no KL); PEFT model -> the
                                           reference is the base with adapters disabled, k3 estimator
AdamW, constant LR, no weight decay        ``optim="adamw_torch"`` (default fused), ``lr_scheduler_type=
                                           "constant"`` (default linear decay), ``learning_rate`` (1e-6)
grad-norm clip 1.0                         ``max_grad_norm=1.0``
no gradient checkpointing                  ``gradient_checkpointing=False`` (TRL's default True)
greedy evaluation, held-out prompts        ``generate(do_sample=False)`` on the same prompts, scored
                                           by ``rl.gate.reward`` (our code)
========================================  =====================================================

What cannot match (also in docs/benchmarks/multilora.md):

- **Advantages**: TRL divides by the group's *sample* standard deviation (``nanstd``, Bessel-corrected)
  plus 1e-4; ours by the *population* one plus 1e-6 (DeepSeekMath). TRL's advantages are ours times
  ``sqrt((G-1)/G)`` (0.91 at G = 6): the policy term is that much weaker against the KL term.
- **Importance ratio**: without vLLM, TRL's "old" log-probs are the policy's own, detached
  (``num_iterations=1``), so the ratio is exactly 1 and the clip never acts: the update is the plain
  policy gradient. Ours compares the bf16 trainer with the float32 vLLM that sampled (the behaviour
  policy), so numerical drift shows up as ratios != 1 and the clip can drop a token's gradient.
- **Sampling**: TRL samples with ``generate`` on the bf16 model (float32 LoRA) and its own RNG
  (``seed``); ours with float32 vLLM and per-request seeds. Same distribution, different draws.
- **Evaluation numerics**: greedy ``generate`` in bf16 here, vLLM in the round; the parent also judges this
  process's saved adapter with the round's own evaluator (vLLM greedy, ``bench/peer_trl.py`` ``judge``), so both
  sides' learning is compared by one judge.
- **Prompt sharing / one pass**: none in TRL (each row whole); ours runs a prompt once for its G rows.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]


def grpo_settings(spec: dict[str, Any], output_dir: str, use_cpu: bool) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments for one experiment of ``spec`` (see the module docstring)."""
    cand, w = spec["candidate"], spec["workload"]
    rows = w["prompts"] * w["group"]
    return {
        "output_dir": output_dir,
        "max_steps": w["steps"],
        "per_device_train_batch_size": rows,
        "gradient_accumulation_steps": 1,
        "num_generations": w["group"],
        "num_iterations": 1,
        "max_completion_length": w["max_new_tokens"],
        "temperature": w["temperature"],
        "top_p": 1.0,
        "top_k": 0,
        "shuffle_dataset": False,
        "learning_rate": cand["learning_rate"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "weight_decay": 0.0,
        "max_grad_norm": w["max_grad_norm"],
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "beta": cand["kl_coef"],
        "epsilon": w["clip_eps"],
        "loss_type": "dapo",
        "scale_rewards": "group",
        "mask_truncated_completions": False,
        "disable_dropout": True,
        "use_vllm": False,
        "seed": spec["seed"],
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
        "use_cpu": use_cpu,
    }


def main(spec_path: str, report_path: str, spawned_at: float) -> None:
    import torch
    import trl  # type: ignore[import-not-found]  # only in the scratch venv (bench/trl_env.py)
    from datasets import Dataset  # type: ignore[import-not-found]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from trainer.model.base import ResidentBase, chat_token_ids, lora_config
    from trainer.config import CandidateConfig, RewardTerm
    from trainer.adapters.lora_tensors import adapter_params, initial_weights
    from trainer.rewards import build_reward

    imported = time.time()
    spec = json.loads(Path(spec_path).read_text())
    cand = CandidateConfig.model_validate(spec["candidate"])
    mix = build_reward(cand.reward)
    gate = build_reward([RewardTerm.model_validate(t) for t in spec["eval_reward"]])

    # --- load: tokenizer, bf16 base, dataset, trainer (PEFT wraps the base inside) ---
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.bfloat16)
    train = Dataset.from_list(
        [{"prompt": r["messages"], "metadata_json": json.dumps(r["metadata"])} for r in spec["train_rows"]]
    )
    step_rewards: list[list[float]] = []

    def reward(prompts: list, completions: list, metadata_json: list[str], **_: Any) -> list[float]:
        values = [
            float(mix(p, c[0]["content"] if isinstance(c, list) else c, json.loads(m)))
            for p, c, m in zip(prompts, completions, metadata_json)
        ]
        step_rewards.append(values)
        return values

    reward.__name__ = "hourglass_reward_mix"
    config = trl.GRPOConfig(
        **grpo_settings(spec, str(Path(report_path).parent / "trl-out"), use_cpu=not torch.cuda.is_available())
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=train,
        processing_class=tok,
        peft_config=lora_config(cand),
    )
    peft_model = trainer.model
    assert isinstance(peft_model, PeftModel)
    # the same start weights as the round's (trainer.adapters.lora_tensors.initial_weights, seeded by name and seed)
    start = initial_weights(cast(ResidentBase, _AsBase(peft_model)), cand.name, cand, None, spec["seed"])
    live = adapter_params(peft_model, "default")
    with torch.no_grad():
        for key, param in live.items():
            param.copy_(start[key].to(param.dtype))
    lora_dtype = str(next(iter(live.values())).dtype)
    loaded = time.time()

    # --- train ---
    trainer.train()
    trained = time.time()
    logs = [h for h in trainer.state.log_history if "reward" in h]

    # --- evaluate: greedy, base (adapters off) and the trained adapter, on the same held-out prompts ---
    eval_rows = spec["eval_rows"]
    ids = [chat_token_ids(tok, r["messages"]) for r in eval_rows]
    peft_model.eval()
    base_texts = _greedy(peft_model, tok, ids, spec["workload"]["max_new_tokens"], adapters=False)
    tuned_texts = _greedy(peft_model, tok, ids, spec["workload"]["max_new_tokens"], adapters=True)

    def mean_score(texts: list[str]) -> float:
        return sum(gate(r["messages"], t, r["metadata"]) for r, t in zip(eval_rows, texts)) / max(1, len(eval_rows))

    evaluated = time.time()
    # the trained adapter (safetensors), for the parent to judge with the round's own evaluator beside (b)'s
    # (bench/peer_trl.py judge); after the timed phases
    adapter_dir = Path(report_path).parent / "adapter"
    peft_model.save_pretrained(str(adapter_dir), safe_serialization=True)
    report = {
        "phases": {
            "imports": imported - spawned_at,
            "load": loaded - imported,
            "train": trained - loaded,
            "evaluate": evaluated - trained,
        },
        "eval_base": mean_score(base_texts),
        "eval_reward": {cand.name: mean_score(tuned_texts)},
        "train_reward": {cand.name: [sum(v) / len(v) for v in step_rewards]},
        "completion_tokens": sum(h.get("completions/mean_length", 0.0) * len(v) for h, v in zip(logs, step_rewards)),
        "kl": [h.get("kl", float("nan")) for h in logs],
        "lora_dtype": lora_dtype,
        "adapter_dir": str(adapter_dir),
        "trl_version": trl.__version__,
    }
    Path(report_path).write_text(json.dumps(report))


class _AsBase:
    """The one attribute of a ``ResidentBase`` that ``initial_weights`` uses: the PEFT model."""

    def __init__(self, model: Any) -> None:
        self.model = model


def _greedy(model: Any, tok: Any, ids: list[list[int]], max_new_tokens: int, *, adapters: bool) -> list[str]:
    """Greedy completions of every prompt in one left-padded ``generate`` call."""
    import contextlib

    import torch

    width = max(len(i) for i in ids)
    pad = tok.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    attention = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    context = contextlib.nullcontext() if adapters else model.disable_adapter()
    with context, torch.no_grad():
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention.to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return tok.batch_decode(out[:, width:], skip_special_tokens=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
