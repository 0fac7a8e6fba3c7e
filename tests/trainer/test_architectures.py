"""The whole path on three architectures (issue 26, step 4): tiny random Llama, Qwen2 and Gemma 3 models built at
test time (``arch_model``), each served by its own vLLM CPU server (``vllm_arch``, one per architecture per session).

Per architecture: the default LoRA targets exist and the LM head is the tied input embedding; a chat with tools is
rendered by vLLM to exactly the prompt ids the trainer renders; an adapter the trainer saves passes staging, hot-loads
into vLLM and gives vLLM's log-probs of its own samples equal to the trainer's (float32 on both sides); the reward
model's head trains on the final-norm hidden state and reloads; one-pass multi-LoRA gradients equal each adapter's
alone. Trainer vs vLLM log-probs of a logged tool-calling conversation are in test_conversation_logprobs (also per
architecture).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from pipeline.serving.staging import base_module_names, check_adapter_config
from pipeline.serving.vllm_models import TESTED_ARCHITECTURES, check_base_folder
from tests.conftest import TinyModel
from tests.trainer.float32_tolerance import LOGPROB_TOL, max_relative_error
from tests.trainer.test_conversations import ADD, CONVERSATION, TOOLS_TEMPLATE
from tests.trainer.test_multi_lora import check_mixed_pass
from trainer import chat
from trainer.adapters.store import make_store
from trainer.config import CandidateConfig, ModelConfig, RewardModelConfig, RLConfig
from trainer.model.base import ResidentBase, load_base
from trainer.types import RolloutRequest
from trainer.rollout.vllm import VLLMEngine

CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def arch_base(arch_model: TinyModel) -> ResidentBase:
    """The tiny model of the architecture as the trainer loads it (float32, CPU), under the template vLLM serves."""
    base = load_base(ModelConfig(name=str(arch_model.path), dtype="float32", device="cpu", max_seq_len=512))
    base.tokenizer.chat_template = TOOLS_TEMPLATE.read_text()  # what vllm_arch serves with (--chat-template)
    return base


def test_architecture_ties_embeddings_and_has_the_default_lora_targets(
    arch_model: TinyModel, arch_base: ResidentBase
) -> None:
    config = json.loads((arch_model.path / "config.json").read_text())
    assert config["architectures"] == [CLASSES[arch_model.arch]] and CLASSES[arch_model.arch] in TESTED_ARCHITECTURES
    report, problems, warnings = check_base_folder(arch_model.path)
    assert problems == [] and report.tied_embeddings and report.chat_template
    # SmolLM2's own template (the tiny Llama's) has no tools; the others carry the ChatML tools template
    assert len(warnings) == (0 if report.template_offers_tools else 1) and all("no tools" in w for w in warnings)
    assert report.template_offers_tools == (arch_model.arch != "llama")
    # tied: the folder holds no LM head; the loaded head is the embedding itself (one tensor, so LoRA on
    # attention/MLP never touches it and saving an adapter never writes it)
    with safe_open(str(arch_model.path / "model.safetensors"), framework="pt") as handle:
        assert not [k for k in handle.keys() if "lm_head" in k]
    lm = arch_base.model.get_base_model()
    assert lm.get_output_embeddings().weight.data_ptr() == lm.get_input_embeddings().weight.data_ptr()
    # the default targets (and the MLP's) are modules of every layer; LoRA wraps each of them
    modules = base_module_names(arch_model.path)
    assert set(CandidateConfig(name="x").target_modules) | set(ALL_LINEAR) <= modules
    store = make_store("offload", arch_base)
    try:
        store.create("all", CandidateConfig(name="all", target_modules=ALL_LINEAR))
        wrapped = {name.split(".")[-1] for name, m in arch_base.model.named_modules() if hasattr(m, "lora_A")}
        assert set(ALL_LINEAR) <= wrapped
    finally:
        store.delete("all")
        store.close()


def test_vllm_renders_a_tools_chat_to_the_trainers_prompt_ids(vllm_arch: str, arch_base: ResidentBase) -> None:
    body = {
        "model": "base",
        "messages": CONVERSATION,
        "tools": [ADD],
        "tool_choice": "auto",
        "max_tokens": 4,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    answer = httpx.post(f"{vllm_arch}/v1/chat/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    served = answer.json()["prompt_token_ids"]
    ours = chat.prompt_token_ids(arch_base.tokenizer, CONVERSATION, [ADD])
    assert served == ours and "<tools>" in arch_base.tokenizer.decode(ours)
    assert served != chat.prompt_token_ids(arch_base.tokenizer, CONVERSATION)  # the tools are in the prompt


def test_trained_adapter_hot_loads_and_vllm_logprobs_equal_the_trainers(
    vllm_arch: str, arch_model: TinyModel, arch_base: ResidentBase, tmp_path: Path
) -> None:
    base = arch_base
    store = make_store("offload", base)
    store.create("cand", CandidateConfig(name="cand", lora_rank=8, target_modules=ALL_LINEAR))
    store.activate("cand")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # an adapter whose effect shows on a random model (a fresh lora_B is zero)
        for p in store.slot_params.values():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    folder = store.save("cand", tmp_path / "cand-v1")
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert check_adapter_config(adapter_config, max_lora_rank=16, base_modules=base_module_names(arch_model.path)) == 8

    engine = VLLMEngine(vllm_arch)
    engine.load("cand", "cand-v1", folder)
    try:
        prompt = tuple(base.chat_token_ids([{"role": "user", "content": "Count to three."}]))
        requests = [
            RolloutRequest(version=v, prompt_id=v, prompt_token_ids=prompt, n=3, max_new_tokens=8, temperature=1.0)
            for v in ("cand-v1", engine.base_name)
        ]
        adapted, plain = engine.generate(requests)
        for group, adapter_on in ((adapted, True), (plain, False)):
            comps = [list(s.token_ids) for s in group]
            with torch.no_grad():
                if adapter_on:
                    store.activate("cand")
                    trainer_BT, mask_BT = base.completion_logprobs([list(prompt)] * len(comps), comps)
                else:
                    with base.reference():
                        trainer_BT, mask_BT = base.completion_logprobs([list(prompt)] * len(comps), comps)
            vllm_BT = torch.zeros_like(trainer_BT)
            for b, s in enumerate(group):
                vllm_BT[b, : len(s.logprobs)] = torch.tensor(s.logprobs)
            worst = max_relative_error(trainer_BT[mask_BT > 0], vllm_BT[mask_BT > 0])
            print(f"{arch_model.arch} adapter={adapter_on}: trainer vs vLLM worst / largest |log-prob| {worst:.2e}")
            assert worst < LOGPROB_TOL, (arch_model.arch, adapter_on, worst)
        # the served adapter is not the base: the base scores the adapter's samples otherwise
        comps = [list(s.token_ids) for s in adapted]
        with torch.no_grad(), base.reference():
            off_BT, mask_BT = base.completion_logprobs([list(prompt)] * len(comps), comps)
        on_BT = torch.zeros_like(off_BT)
        for b, s in enumerate(adapted):
            on_BT[b, : len(s.logprobs)] = torch.tensor(s.logprobs)
        assert max_relative_error(off_BT[mask_BT > 0], on_BT[mask_BT > 0]) > 100 * LOGPROB_TOL
    finally:
        engine.unload("cand-v1")
        store.delete("cand")
        store.close()


def test_reward_model_head_trains_and_reloads(arch_base: ResidentBase, tmp_path: Path) -> None:
    from trainer.reward_model.model import TokenisedFeedback, create_reward_model, train_reward_model

    base = arch_base
    store = make_store("offload", base)
    cfg = RewardModelConfig(steps=3, batch_size=8, learning_rate=5e-3)
    model = create_reward_model(base, store, cfg, None)
    try:
        prompt = base.chat_token_ids([{"role": "user", "content": "Name a fruit."}])
        good = base.tokenizer(" banana", add_special_tokens=False)["input_ids"]
        bad = base.tokenizer(" gravel", add_special_tokens=False)["input_ids"]
        data = TokenisedFeedback(
            examples=tuple((prompt, ids, label) for ids, label in ((good, True), (bad, False)) for _ in range(4)),
            pairs=((prompt, good, bad),),
        )
        before = model.score([prompt, prompt], [good, bad])
        history = train_reward_model(model, data, cfg)
        after = model.score([prompt, prompt], [good, bad])
        assert history[-1]["reward_model/loss"] < history[0]["reward_model/loss"]
        assert after[0] - after[1] > before[0] - before[1] and after[0] > after[1]
        # the head reads the hidden state after the final norm (the LM head's input), of the last real token
        lm = base.model.get_base_model()
        hidden = {}
        handle = lm.get_output_embeddings().register_forward_hook(lambda m, a, o: hidden.setdefault("x", a[0]))
        try:
            store.activate(model.name)
            with torch.no_grad():
                lm(input_ids=torch.tensor([prompt + good]), use_cache=False)
                want = model.head(hidden["x"][:, -1].float()).squeeze(-1)
        finally:
            handle.remove()
        assert float(want) == pytest.approx(after[0], abs=1e-5)
        again = create_reward_model(base, store, cfg, model.save(tmp_path / "rm"), name="rm-again")
        assert again.score([prompt, prompt], [good, bad]) == pytest.approx(after, abs=1e-5)
    finally:
        for name in list(store.names()):
            store.delete(name)
        store.close()


def test_one_pass_gradients_equal_each_adapter_alone(arch_base: ResidentBase) -> None:
    check_mixed_pass(arch_base)


def test_lora_targets_the_architecture_lacks_are_refused_at_round_setup(
    arch_model: TinyModel, arch_base: ResidentBase, tmp_path: Path
) -> None:
    """PEFT adapts the target names that match and skips the rest silently (one match is enough): a name of another
    architecture, or the tied LM head (absent from the safetensors, refused by staging after the round), would
    train other weights than configured. The round refuses them when the base is loaded, every one at once."""
    from trainer.data import round_inputs, snapshot_table, split_snapshot
    from trainer.errors import TrainerConfigError
    from trainer.round import RoundParts, run_round
    from trainer.tasks import reasoning_gym_prompts
    from trainer.types import RoundSpec

    assert arch_base.target_module_problems("ok", ALL_LINEAR + ["embed_tokens"]) == []
    other = CandidateConfig(name="gpt2-names", target_modules=["q_proj", "c_attn"])
    head = CandidateConfig(name="head", target_modules=["v_proj", "lm_head"])
    train, heldout = split_snapshot(snapshot_table(reasoning_gym_prompts("basic_arithmetic", 4, seed=2)), 0.25)
    spec = RoundSpec(ModelConfig(name=str(arch_model.path)), (other, head), RLConfig(rollout={"engine": "hf"}))
    with pytest.raises(TrainerConfigError) as err:
        run_round(spec, round_inputs(train, heldout), tmp_path, parts=RoundParts(base=arch_base))
    message = str(err.value)
    assert "gpt2-names: target_modules ['c_attn'] are not modules of the base model" in message
    assert CLASSES[arch_model.arch] in message and "'q_proj'" in message  # the names it has
    assert "head: target_modules ['lm_head'] is the LM head, which this base ties" in message
    assert not (tmp_path / "gpt2-names").exists() and not (tmp_path / "head").exists()
