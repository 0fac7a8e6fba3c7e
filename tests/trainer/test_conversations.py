"""Training on conversations (issue 26, step 3): a snapshot row's logged ids are what every algorithm trains on
(never a second rendering), rows without them are rendered with the tools they offered, the loss covers only the
rated assistant turn's tokens, GRPO rollouts regenerate that turn from the same prompt ids and their rewards see
the tools offered, and v1 single-turn rows render as before.

The model is the tiny random Llama with SmolLM2's tokenizer, under Hourglass's ChatML tools template (the one the
``vllm_tiny`` fixture serves with), in float32 on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.float32_tolerance import GRAD_TOL, assert_gradients_close
from trainer import chat
from trainer.config import Algorithm, CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.data import feedback_data, prompts_from_table, snapshot_table
from trainer.types import Prompt, Sample

TOOLS_TEMPLATE = Path(__file__).resolve().parents[2] / "trainer" / "templates" / "chatml_tools.jinja"
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
SYSTEM = "You are a careful calculator assistant."


def _call(call_id: str, a: int, b: int) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}


# system prompt, a user turn, an assistant tool call, its tool result, the assistant's text, a second user turn:
# the rated turn is the next assistant turn (a tool call, or a text answer)
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [_call("c1", 2, 3)]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 40 + 2?"},
]
RATED_CALL = [_call("c2", 40, 2)]


@pytest.fixture(scope="module")
def base(arch_model):  # every test on the base runs on each architecture (Llama, Qwen2, Gemma 3)
    from trainer.model.base import load_base

    b = load_base(ModelConfig(name=str(arch_model.path), dtype="float32", device="cpu", max_seq_len=1024))
    b.tokenizer.chat_template = TOOLS_TEMPLATE.read_text()  # the template vllm_tiny serves with
    return b


def _row(base, trace_id: str, reward: float, calls: list[dict] | None, text: str = "", **kw: Any) -> Prompt:
    """A v2 row as the gateway logs it: the prompt's and the answer's ids as vLLM rendered them."""
    answer = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
    fields: dict[str, Any] = dict(
        prompt_id=trace_id,
        messages=CONVERSATION,
        metadata={"user_hash": "u1"},
        logged_completion=text,
        logged_token_ids=chat.answer_token_ids(base.tokenizer, CONVERSATION, answer, [ADD]),
        logged_reward=reward,
        tools=[ADD],
        logged_prompt_token_ids=chat.prompt_token_ids(base.tokenizer, CONVERSATION, [ADD]),
        logged_tool_calls=calls,
    )
    return Prompt(**(fields | kw))


# --- 1. the snapshot's conversation columns reach the prompts, the reward model's examples and pairs -------


def test_conversation_columns_reach_prompts_examples_and_pairs() -> None:
    v2 = Prompt(
        "t-up",
        CONVERSATION,
        {"user_hash": "u1"},
        logged_completion="",
        logged_token_ids=[7, 8],
        logged_reward=1.0,
        tools=[ADD],
        logged_prompt_token_ids=[1, 2, 3],
        logged_tool_calls=RATED_CALL,
    )
    down = Prompt(
        "t-down",
        CONVERSATION,
        {"user_hash": "u1"},
        logged_completion="no idea",
        logged_reward=-1.0,
        tools=[ADD],
        logged_prompt_token_ids=[1, 2, 4],
    )
    other_tools = Prompt("t-other", CONVERSATION, {}, logged_completion="x", logged_reward=-1.0, tools=[ADD, ADD])
    v1 = Prompt("t-v1", [{"role": "user", "content": "hi"}], {"a": 1}, logged_completion="hello", logged_reward=1.0)
    rows = {p.prompt_id: p for p in prompts_from_table(snapshot_table([v2, down, other_tools, v1]))}
    got = rows["t-up"]
    assert (got.tools, got.logged_prompt_token_ids, got.logged_tool_calls) == ([ADD], [1, 2, 3], RATED_CALL)
    assert got.metadata == {"user_hash": "u1", "tools": [ADD]}  # where the tool-call rewards read them
    assert got.messages[2]["tool_calls"] == CONVERSATION[2]["tool_calls"] and got.messages[3]["tool_call_id"] == "c1"
    assert rows["t-v1"] == v1  # a v1 row reads as before: no tools, no logged prompt ids, metadata untouched
    assert prompts_from_table(snapshot_table([v1])) == [v1]  # and a snapshot without the v2 columns too
    feedback = feedback_data(list(rows.values()))
    up_example = next(e for e in feedback.examples if e.trace_id == "t-up")
    assert (up_example.tools, up_example.prompt_token_ids, up_example.tool_calls) == ([ADD], (1, 2, 3), RATED_CALL)
    # one pair: same messages and same tools; the row offering other tools is another prompt
    (pair,) = feedback.pairs
    assert (pair.chosen_token_ids, pair.rejected, pair.prompt_token_ids) == ((7, 8), "no idea", (1, 2, 3))
    assert (pair.tools, pair.chosen_tool_calls, pair.rejected_tool_calls) == ([ADD], RATED_CALL, None)


def test_unreadable_tools_column_names_the_row() -> None:
    from trainer.errors import DataError

    table = snapshot_table([Prompt("t1", CONVERSATION, {}, tools=[ADD])])
    table = table.set_column(table.column_names.index("tools"), "tools", [["{not json"]])
    with pytest.raises(DataError, match="row 't1': tools is not JSON"):
        prompts_from_table(table)


# --- 2. logged ids first, else the rendering with the tools offered ------------------------------------------


def test_prompt_ids_are_the_logged_ids_as_served_else_rendered_with_tools(base) -> None:
    from trainer.plan import PromptTokens

    tokens = PromptTokens(base, RLConfig())
    rendered = chat.prompt_token_ids(base.tokenizer, CONVERSATION, [ADD])
    assert "<tools>" in base.tokenizer.decode(rendered) and '"name": "add"' in base.tokenizer.decode(rendered)
    served = [*rendered[:5], 1234, *rendered[5:]]  # what vLLM served differs from today's rendering: it wins
    assert tokens(Prompt("a", CONVERSATION, tools=[ADD], logged_prompt_token_ids=served)) == served
    assert tokens(Prompt("b", CONVERSATION, tools=[ADD])) == rendered  # no logged ids: rendered with the tools
    assert tokens(Prompt("c", CONVERSATION)) == chat.prompt_token_ids(base.tokenizer, CONVERSATION)  # no tools
    assert tokens(Prompt("c", CONVERSATION)) != rendered
    vocab = base.model.get_input_embeddings().num_embeddings
    bad = Prompt("d", CONVERSATION, tools=[ADD], logged_prompt_token_ids=[1, vocab])  # an id the base cannot embed
    assert tokens(bad) == rendered


def test_single_turn_v1_rows_render_as_before(base, tiny_model: Path) -> None:
    """The demo's rows (single-turn, no tools, no logged prompt ids) get the ids the trainer gave them before
    conversations: ``apply_chat_template(tokenize=True)`` of the model's own template."""
    from transformers import AutoTokenizer

    from trainer.plan import PromptTokens

    own = AutoTokenizer.from_pretrained(tiny_model)  # SmolLM2's own template, what the demo's trainer uses
    plain = Prompt("v1", [{"role": "user", "content": "What is 3 + 4? Answer with the number."}])
    before: Any = own.apply_chat_template(plain.messages, add_generation_prompt=True, tokenize=True)
    before = list(before["input_ids"] if hasattr(before, "keys") else before)
    swapped = base.tokenizer.chat_template
    base.tokenizer.chat_template = own.chat_template
    try:
        assert PromptTokens(base, RLConfig())(plain) == before
    finally:
        base.tokenizer.chat_template = swapped
    assert PromptTokens(base, RLConfig())(plain) == before  # the tools template renders tool-free chats the same


def test_every_logged_row_algorithm_uses_the_logged_ids(base) -> None:
    """KTO, offline IS and the reward model train on the row's logged prompt and completion ids; a tool-call
    answer without logged ids is rendered by the template after the conversation (through its end of turn)."""
    from trainer.algorithms.kto import kto_batch
    from trainer.algorithms.offline_is import offline_batch
    from trainer.plan import PromptTokens
    from trainer.reward_model.model import tokenise_feedback
    from trainer.rewards import build_reward

    served_prompt = [*chat.prompt_token_ids(base.tokenizer, CONVERSATION, [ADD]), 42]  # differs from a rendering
    up = _row(base, "up", 1.0, RATED_CALL, logged_prompt_token_ids=served_prompt)
    down = _row(base, "down", -1.0, None, text="I cannot add.", logged_token_ids=[11, 12, 13])
    unlogged = _row(base, "bare", -1.0, RATED_CALL, logged_token_ids=None, logged_prompt_token_ids=None)
    rows = [up, down, unlogged]
    rendered_prompt = chat.prompt_token_ids(base.tokenizer, CONVERSATION, [ADD])
    rendered_call = chat.answer_token_ids(
        base.tokenizer, CONVERSATION, {"role": "assistant", "content": "", "tool_calls": RATED_CALL}, [ADD]
    )
    assert rendered_call is not None and base.tokenizer.decode(rendered_call).endswith("</tool_call><|im_end|>")
    want_prompts = [served_prompt, rendered_prompt, rendered_prompt]
    want_answers = [up.logged_token_ids, [11, 12, 13], rendered_call]

    ids = PromptTokens(base, RLConfig()).many(rows)
    kto = CandidateConfig(name="k", algorithm=Algorithm.KTO, reward=[RewardTerm(fn="logged")])
    for batch in (
        kto_batch(kto, rows, ids, base, build_reward(kto.reward))[0],
        offline_batch(rows, ids, base, build_reward([RewardTerm(fn="logged")]))[0],
    ):
        assert batch.prompt_ids == want_prompts and batch.completion_ids == want_answers
    tokenised = tokenise_feedback(base, feedback_data(rows))
    assert [(p, c) for p, c, _ in tokenised.examples] == list(zip(want_prompts, want_answers))
    assert tokenised.pairs == (
        (served_prompt, up.logged_token_ids, [11, 12, 13]),
        (served_prompt, up.logged_token_ids, rendered_call),
    )


# --- 3. the loss covers the rated turn only ----------------------------------------------------------------


def _lora_grads(base) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in base.model.named_parameters() if p.grad is not None}


def test_loss_only_on_the_rated_turn_prompt_tokens_get_zero_gradient(base) -> None:
    """The trainer's KTO loss on a multi-turn tool-calling row equals the same loss taken on a forward over the
    whole conversation with a per-token mask that is 1 on the rated turn only (system prompt, earlier turns, tool
    calls and tool results 0): equal LoRA gradients (float32 rounding, ``GRAD_TOL``), while the gradient of that
    loss w.r.t. every masked token's log-prob is exactly 0. A mask that also covered the earlier assistant turn
    (the bug this guards against) moves the gradients far beyond the tolerance; perturbing tokens inside the prompt
    changes neither the completion ids nor the loss mask."""
    from trainer.adapters.resident import ResidentStore
    from trainer.algorithms.batch import LossInputs
    from trainer.algorithms.core import candidate_loss
    from trainer.algorithms.kto import kto_batch
    from trainer.plan import PromptTokens
    from trainer.rewards import build_reward

    kto = CandidateConfig(
        name="k", algorithm=Algorithm.KTO, reward=[RewardTerm(fn="logged")], lora_rank=4, kl_coef=0.05
    )
    store = ResidentStore(base)
    store.create("k", kto)
    optimizer = store.activate("k")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a non-zero lora_B so both LoRA factors get gradients
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    rows = [_row(base, "up", 1.0, RATED_CALL), _row(base, "down", -1.0, None, text="It is 41.")]
    rows[1] = Prompt(**{**rows[1].__dict__, "logged_token_ids": None})  # tokenised text
    rl = RLConfig()
    batch, _ = kto_batch(kto, rows, PromptTokens(base, rl).many(rows), base, build_reward(kto.reward))
    n_prompt = [len(r.logged_prompt_token_ids or []) for r in rows]  # the mask's edge, from the logged row alone
    assert [len(p) for p in batch.prompt_ids] == n_prompt

    def trainer_loss() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad(), base.reference():
            ref_BT, _ = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
        lp_BT, mask_BT = base.completion_logprobs(batch.prompt_ids, batch.completion_ids)
        return candidate_loss(LossInputs(base, kto, rl, batch, lp_BT, ref_BT, mask_BT))[0], mask_BT

    base.model.zero_grad(set_to_none=True)
    loss, mask_BT = trainer_loss()
    loss.backward()
    trainer_grads = _lora_grads(base)
    assert trainer_grads and all(g.abs().max() > 0 for g in trainer_grads.values())
    assert mask_BT.sum(1).tolist() == [float(len(c)) for c in batch.completion_ids]

    # the whole conversation in one forward: log-probs of every token after the first, prompt and answer alike
    seqs = [p + c for p, c in zip(batch.prompt_ids, batch.completion_ids)]
    rated_turn_BS = [[float(t >= n - 1) for t in range(len(s) - 1)] for s, n in zip(seqs, n_prompt)]
    prior_turns_BS = [[1.0] * len(s) for s in rated_turn_BS]  # the planted bug: earlier turns in the loss too

    def masked_loss(mask_rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
        firsts, rests = [s[:1] for s in seqs], [s[1:] for s in seqs]
        with torch.no_grad(), base.reference():
            ref_full, _ = base.completion_logprobs(firsts, rests)
        full, pad = base.completion_logprobs(firsts, rests)
        full.retain_grad()
        keep = torch.zeros_like(pad)
        for b, row in enumerate(mask_rows):
            keep[b, : len(row)] = torch.tensor(row)
        # each row's kept log-probs moved to the front, as the loss takes them (column t = token t of the answer)
        order = torch.argsort(1 - keep, dim=1, stable=True)
        T = int(keep.sum(1).max())
        pick = lambda x: x.gather(1, order)[:, :T]  # noqa: E731
        sub = LossInputs(
            base, kto, rl, _with_kept(batch, keep, seqs), pick(full * keep), pick(ref_full * keep), pick(keep)
        )
        return candidate_loss(sub)[0], full

    base.model.zero_grad(set_to_none=True)
    full_loss, full = masked_loss(rated_turn_BS)
    full_loss.backward()
    assert full_loss.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    margin = assert_gradients_close(trainer_grads, _lora_grads(base), GRAD_TOL, "rated-turn mask")
    print(f"trainer vs whole-conversation forward with the rated-turn mask: worst error / GRAD_TOL = {margin}")
    assert full.grad is not None
    for b, n in enumerate(n_prompt):
        assert torch.all(full.grad[b, : n - 1] == 0)  # system prompt, earlier turns, tool results: exactly 0
        assert torch.count_nonzero(full.grad[b, n - 1 : len(seqs[b]) - 1]) > 0  # the rated turn's tokens: not

    base.model.zero_grad(set_to_none=True)
    masked_loss(prior_turns_BS)[0].backward()
    worst = max(
        float((g - trainer_grads[k]).abs().max() / trainer_grads[k].abs().max()) for k, g in _lora_grads(base).items()
    )
    assert worst > 100 * GRAD_TOL, worst  # the planted bug is far outside the tolerance
    base.model.zero_grad(set_to_none=True)

    # perturbing tokens inside the prompt (the tool result, the earlier answer) moves nothing in the loss mask
    edited = [r for r in batch.prompt_ids[0]]
    edited[n_prompt[0] // 2] = 4242
    edited[-10] = 4243
    with torch.no_grad():
        _, mask_edit = base.completion_logprobs([edited, batch.prompt_ids[1]], batch.completion_ids)
    assert torch.equal(mask_edit, mask_BT)
    store.close()


def _with_kept(batch, keep: torch.Tensor, seqs: list[list[int]]):
    """``batch`` with each row's completion = its kept tokens (the KTO reference point's shifted rows use them)."""
    from dataclasses import replace

    comps = [[s[t + 1] for t in range(len(s) - 1) if keep[b, t] > 0] for b, s in enumerate(seqs)]
    prompts = [s[: len(s) - len(c)] for s, c in zip(seqs, comps)]
    return replace(batch, prompt_ids=prompts, completion_ids=comps)


# --- 4. GRPO regenerates the rated turn from the same prompt ids; its rewards see the tools ---------------------


def test_grpo_rollouts_regenerate_the_rated_turn_and_rewards_judge_their_tool_calls(base) -> None:
    from trainer.adapters.resident import ResidentStore
    from trainer.algorithms.losses import group_advantages
    from trainer.algorithms.ppo import rollout_batch
    from trainer.executors.local import rollout_step
    from trainer.plan import PromptTokens
    from trainer.rewards import build_reward
    from trainer.rollout.hf import HFEngine

    row = prompts_from_table(snapshot_table([_row(base, "t", 1.0, RATED_CALL)]))[0]
    rl = RLConfig.model_validate({"rollout": {"group_size": 2, "max_new_tokens": 3}})
    store = ResidentStore(base)
    engine = HFEngine(base, store)
    seen: list[tuple[int, ...]] = []
    generate = engine.generate
    engine.generate = lambda requests: seen.extend(r.prompt_token_ids for r in requests) or generate(requests)  # type: ignore[method-assign]
    tokens = PromptTokens(base, rl)
    groups, _ = rollout_step(engine, tokens, {"g": "base"}, {"g": [row]}, rl, 0)
    assert seen == [tuple(row.logged_prompt_token_ids or [])]  # the conversation up to the rated turn, tools included
    assert len(groups["g"][0]) == 2
    store.close()

    # the rewards of a group judge each rollout's tool calls against the tools the row offered
    def sample(text: str) -> Sample:
        return Sample("t", text, (1,), (-1.0,), "base")

    texts = [
        '<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "mul", "arguments": {"a": 40, "b": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "add", "arguments": {"a": "40"}}\n</tool_call>',
    ]
    reward = build_reward([RewardTerm(fn="tool_call_exists"), RewardTerm(fn="tool_call_valid")])
    assert reward.accepts(row.metadata)  # the row offered tools: the tool-call rewards can score it
    batch, _ = rollout_batch([row], [tokens(row)], [[sample(t) for t in texts]], reward, group_advantages)
    assert batch.rewards == [2.0, 0.0, 1.0]


def test_logged_tool_call_answers_are_judged_by_the_tool_call_rewards(base) -> None:
    """A logged answer that only calls tools (``completion`` ``""``) reaches KTO's and offline IS's rewards as its
    calls in the Hermes text the rewards read (the arguments as the model wrote them), judged against the tools
    the row offered; a v1 row's text reaches them unchanged."""
    from trainer.algorithms.batch import logged_text
    from trainer.algorithms.kto import kto_batch
    from trainer.algorithms.offline_is import offline_batch
    from trainer.plan import PromptTokens
    from trainer.rewards import build_reward
    from trainer.tool_calls import hermes_tool_calls

    bad_args = [{**RATED_CALL[0], "function": {"name": "add", "arguments": '{"a": 40,'}}]
    mul = [{**RATED_CALL[0], "function": {"name": "mul", "arguments": '{"a": 1, "b": 2}'}}]
    rows = [
        prompts_from_table(snapshot_table([_row(base, t, 1.0, calls)]))[0]
        for t, calls in (("ok", RATED_CALL), ("bad", bad_args), ("mul", mul))
    ]
    assert [(c.name, c.arguments) for c in hermes_tool_calls(logged_text(rows[0]))] == [("add", {"a": 40, "b": 2})]
    terms = [RewardTerm(fn="tool_call_json"), RewardTerm(fn="tool_call_exists", weight=10.0)]
    ids = PromptTokens(base, RLConfig()).many(rows)
    assert offline_batch(rows, ids, base, build_reward(terms))[0].rewards == [11.0, 0.0, 1.0]
    kto = CandidateConfig(name="k", algorithm=Algorithm.KTO, reward=[RewardTerm(fn="logged"), *terms])
    assert kto_batch(kto, rows, ids, base, build_reward(kto.reward))[0].rewards == [12.0, 1.0, 2.0]
    text = Prompt("v1", [{"role": "user", "content": "hi"}], logged_completion="<b>hello</b>")
    assert logged_text(text) == "<b>hello</b>"
