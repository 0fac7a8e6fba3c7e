"""Trainer and vLLM log-probs of the same logged ids agree on a multi-turn, tool-calling conversation.

The conversation (system prompt, a user turn, a tool call, its result, a text answer, a second user turn) is
rendered by :mod:`trainer.chat` with the tools offered, under the ChatML tools template the vLLM servers run
with; its rated turn is a tool call rendered the same way. vLLM (the CPU build, float32) scores the prompt and
answer ids as a prompt (``prompt_logprobs``) and samples its own answers to the same prompt ids (GRPO's
rollouts); the trainer (float32, the base with adapters off) scores the same ids with
:meth:`~trainer.model.base.ResidentBase.completion_logprobs`. On each architecture of ``arch_model`` (Llama, Qwen2,
Gemma 3), each served by its own ``vllm_arch`` server.
"""

from __future__ import annotations

import httpx
import torch

from tests.conftest import TinyModel
from tests.trainer.float32_tolerance import LOGPROB_TOL
from tests.trainer.test_conversations import ADD, CONVERSATION, RATED_CALL, TOOLS_TEMPLATE
from trainer import chat
from trainer.config import ModelConfig

VLLM_LOGPROB_TOL = LOGPROB_TOL
"""Largest per-token ``|trainer - vLLM|`` over the largest ``|log-prob|``: float32_tolerance.LOGPROB_TOL (1e-6, ~17 U
of the largest |log-prob|), the bound of two float32 paths that sum the same products in another order. vLLM's CPU
build in float32 is one more such path (its own attention and fused kernels). Measured on this 285-token
conversation (AMD EPYC, avx512_bf16): mean |diff| 1.4e-7 nats on the logged answer's 35 tokens and 1.6e-7 on 48
sampled tokens, worst 8.5e-8 of the largest |log-prob| (about 12x under the bound). The prompt rendered without
its tools, or the answer scored one position off, moves log-probs by more than 100x the bound (asserted below)."""


def _vllm_prompt_logprobs(url: str, ids: list[int], start: int) -> list[float]:
    """vLLM's log-prob of each of ``ids[start:]`` given the ids before it (``prompt_logprobs``)."""
    body = {"model": "base", "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=300).raise_for_status().json()
    scored = answer["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    return [float(scored[t][str(ids[t])]["logprob"]) for t in range(start, len(ids))]


def test_trainer_and_vllm_logprobs_of_logged_conversation_ids_agree(vllm_arch: str, arch_model: TinyModel) -> None:
    from trainer.model.base import load_base
    from trainer.types import BASE_VERSION, RolloutRequest
    from trainer.rollout.vllm import VLLMEngine

    base = load_base(ModelConfig(name=str(arch_model.path), dtype="float32", device="cpu", max_seq_len=512))
    base.tokenizer.chat_template = TOOLS_TEMPLATE.read_text()
    prompt = chat.prompt_token_ids(base.tokenizer, CONVERSATION, [ADD])
    answer = chat.answer_token_ids(
        base.tokenizer, CONVERSATION, {"role": "assistant", "content": "", "tool_calls": RATED_CALL}, [ADD]
    )
    assert answer is not None and "<tools>" in base.tokenizer.decode(prompt)

    # the logged answer's ids, scored by both
    vllm_T = torch.tensor(_vllm_prompt_logprobs(vllm_arch, prompt + answer, len(prompt)))
    with torch.no_grad(), base.reference():
        trainer_1T, _ = base.completion_logprobs([prompt], [answer])
    diff_T = (trainer_1T[0] - vllm_T).abs()

    # GRPO's rollouts of the rated turn: vLLM samples from the same prompt ids, the trainer re-scores its tokens
    (group,) = VLLMEngine(vllm_arch).generate(
        [RolloutRequest(BASE_VERSION, "t", tuple(prompt), n=4, max_new_tokens=12, temperature=1.0, seed=7)]
    )
    comps = [list(s.token_ids) for s in group]
    with torch.no_grad(), base.reference():
        sampled_BT, mask_BT = base.completion_logprobs([prompt] * len(comps), comps)
    vllm_BT = torch.zeros_like(sampled_BT)
    for b, s in enumerate(group):
        vllm_BT[b, : len(s.logprobs)] = torch.tensor(s.logprobs)
    sampled_diff = (sampled_BT - vllm_BT).abs()[mask_BT > 0]

    scale = max(float(vllm_T.abs().max()), float(vllm_BT.abs().max()))
    logged_mae, sampled_mae = float(diff_T.mean()), float(sampled_diff.mean())
    worst = max(float(diff_T.max()), float(sampled_diff.max())) / scale
    print(
        f"{arch_model.arch}: {len(prompt)} prompt tokens; trainer vs vLLM log-probs (nats), mean |diff|: logged answer "
        f"{logged_mae:.2e} over {len(answer)} tokens, vLLM's samples {sampled_mae:.2e} over {len(sampled_diff)}; "
        f"worst / largest |log-prob| = {worst:.2e} (bound {VLLM_LOGPROB_TOL:.0e})"
    )
    assert worst < VLLM_LOGPROB_TOL

    # the bound tells the right ids from wrong ones: the prompt rendered without its tools, the answer shifted by one
    bare = chat.prompt_token_ids(base.tokenizer, CONVERSATION)
    with torch.no_grad(), base.reference():
        no_tools_1T, _ = base.completion_logprobs([bare], [answer])
        shifted_1T, _ = base.completion_logprobs([prompt + answer[:1]], [answer[1:]])
    assert float((no_tools_1T[0] - vllm_T).abs().max()) / scale > 100 * VLLM_LOGPROB_TOL
    assert float((shifted_1T[0] - vllm_T[:-1]).abs().max()) / scale > 100 * VLLM_LOGPROB_TOL
