"""The vLLM rollout engine against a real vLLM CPU server (``vllm_tiny``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from trainer.adapters.store import make_store
from trainer.model.base import load_base
from trainer.config import CandidateConfig, ModelConfig
from trainer.errors import RolloutError
from trainer.types import RolloutRequest
from trainer.rollout.vllm import VLLMEngine

pytestmark = pytest.mark.integration


class RecordingEngine(VLLMEngine):
    """Records when each completion request starts and ends (event order only)."""

    def __init__(self, url: str, **kwargs) -> None:
        super().__init__(url, **kwargs)
        self.events: list[str] = []

    async def _post_completion(self, client: httpx.AsyncClient, body: dict) -> dict:
        self.events.append(f"start:{body['model']}")
        try:
            return await super()._post_completion(client, body)
        finally:
            self.events.append(f"end:{body['model']}")


def _perturb(store, name: str, seed: int) -> None:
    store.activate(name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in store.slot_params.values():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)


def test_two_adapters_in_flight_logprobs_and_versioned_push(vllm_tiny: str, tiny_model: Path, tmp_path: Path) -> None:
    base = load_base(ModelConfig(name=str(tiny_model)))
    store = make_store("offload", base)
    for name in ("a", "b"):
        store.create(name, CandidateConfig(name=name, lora_rank=8, target_modules=["q_proj", "v_proj", "o_proj"]))
        _perturb(store, name, seed=len(name) + ord(name))
    engine = RecordingEngine(vllm_tiny)
    engine.load("a", "a-s0", store.save("a", tmp_path / "a-s0"))
    engine.load("b", "b-s0", store.save("b", tmp_path / "b-s0"))
    try:
        prompt = tuple(base.chat_token_ids([{"role": "user", "content": "Count to three."}]))
        requests = [
            RolloutRequest(
                version=v, prompt_id=f"p{i}", prompt_token_ids=prompt, n=3, max_new_tokens=6, temperature=1.0, seed=i
            )
            for i, v in enumerate(["a-s0", "b-s0", "a-s0", "b-s0"])
        ]
        groups = engine.generate(requests)

        # requests that differ only in their prompt share one call: one per version (the seeds are
        # not sent), and both versions' calls were sent before the first answer came back
        assert sorted(e for e in engine.events if e.startswith("start:")) == ["start:a-s0", "start:b-s0"]
        first_end = next(i for i, e in enumerate(engine.events) if e.startswith("end:"))
        assert sum(e.startswith("start:") for e in engine.events[:first_end]) == 2
        for req, group in zip(requests, groups):
            assert len(group) == 3 and {s.adapter_version for s in group} == {req.version}
            for s in group:
                assert 1 <= len(s.token_ids) == len(s.logprobs) <= 6
                assert all(lp <= 0.0 for lp in s.logprobs)

        # vLLM's log-probs of its own tokens match the trainer's under the same adapter
        for name, group in (("a", groups[0]), ("b", groups[1])):
            store.activate(name)
            with torch.no_grad():
                lp_BT, _ = base.completion_logprobs([list(prompt)] * 3, [list(s.token_ids) for s in group])
            for row, s in enumerate(group):
                torch.testing.assert_close(lp_BT[row, : len(s.logprobs)], torch.tensor(s.logprobs), atol=2e-2, rtol=0)

        # an update is pushed under a new name; the old name is unloaded, never reloaded in place
        _perturb(store, "a", seed=99)
        engine.load("a", "a-s1", store.save("a", tmp_path / "a-s1"))
        engine.unload("a-s0")
        served = engine.served_models()
        assert "a-s1" in served and "b-s0" in served and "a-s0" not in served
        with pytest.raises(RolloutError, match="already loaded"):
            engine.load("a", "a-s1", tmp_path / "a-s1")
        with pytest.raises(RolloutError, match="not loaded"):
            engine.generate(
                [RolloutRequest(version="a-s0", prompt_id="x", prompt_token_ids=prompt, n=1, max_new_tokens=2)]
            )
        stale = httpx.post(
            f"{vllm_tiny}/v1/completions", json={"model": "a-s0", "prompt": list(prompt), "max_tokens": 2}
        )
        assert stale.status_code == 404
        greedy = engine.generate(
            [
                RolloutRequest(
                    version="a-s1", prompt_id="g", prompt_token_ids=prompt, n=1, max_new_tokens=4, temperature=0.0
                )
            ]
        )
        store.activate("a")
        with torch.no_grad():
            lp_BT, _ = base.completion_logprobs([list(prompt)], [list(greedy[0][0].token_ids)])
        torch.testing.assert_close(
            lp_BT[0, : len(greedy[0][0].logprobs)], torch.tensor(greedy[0][0].logprobs), atol=2e-2, rtol=0
        )
    finally:
        for version in list(engine.versions):
            engine.unload(version)


def test_batched_prompts_come_back_in_request_order(vllm_tiny: str, tiny_model: Path) -> None:
    """Prompts batched into one call (a batch cap that splits them) give each request its own prompt's
    answers: the same greedy answers as one call per request; with n > 1, vLLM numbers a batch's
    choices prompt_index * n + k, which the engine relies on."""
    base = load_base(ModelConfig(name=str(tiny_model)))
    prompts = [
        tuple(base.chat_token_ids([{"role": "user", "content": f"What is {i} + {i}?" * (i + 1)}])) for i in range(5)
    ]
    requests = [
        RolloutRequest(version="base", prompt_id=f"p{i}", prompt_token_ids=p, n=1, max_new_tokens=5, temperature=0.0)
        for i, p in enumerate(prompts)
    ]
    batched = RecordingEngine(vllm_tiny, max_prompts_per_request=2, max_in_flight=2)
    groups = batched.generate(requests)
    assert sum(e.startswith("start:") for e in batched.events) == 3  # 5 prompts, at most 2 per call
    alone = [VLLMEngine(vllm_tiny).generate([req])[0] for req in requests]
    distinct = {tuple(round(x, 3) for x in g[0].logprobs) for g in alone}
    assert len(distinct) == len(prompts), "each prompt's answer must be told apart (by its log-probs)"
    for req, group, single in zip(requests, groups, alone):
        assert [s.prompt_id for s in group] == [req.prompt_id]
        assert group[0].token_ids == single[0].token_ids
        assert group[0].logprobs == pytest.approx(single[0].logprobs, abs=1e-4)

    # the upstream numbering: choice i of a batched call answers prompt i // n
    body = {
        "model": "base",
        "prompt": [list(p) for p in prompts[:3]],
        "n": 2,
        "max_tokens": 2,
        "return_token_ids": True,
    }
    choices = sorted(
        httpx.post(f"{vllm_tiny}/v1/completions", json=body, timeout=60).json()["choices"], key=lambda c: c["index"]
    )
    assert [c["index"] for c in choices] == list(range(6))
    assert [c["prompt_token_ids"] for c in choices] == [list(prompts[i // 2]) for i in range(6)]
    sampled = batched.generate(
        [
            RolloutRequest(version="base", prompt_id=f"s{i}", prompt_token_ids=p, n=3, max_new_tokens=3)
            for i, p in enumerate(prompts)
        ]
    )
    assert [[s.prompt_id for s in g] for g in sampled] == [[f"s{i}"] * 3 for i in range(5)]
    assert all(1 <= len(s.token_ids) == len(s.logprobs) <= 3 for g in sampled for s in g)


@pytest.mark.parametrize(
    ("choices", "match"),
    [
        ([{"index": 0, "text": "a", "token_ids": [1], "logprobs": {"token_logprobs": [-0.1]}}], "returned 0 choices"),
        ([{"index": 5, "text": "a", "token_ids": [1], "logprobs": {"token_logprobs": [-0.1]}}], "index 5"),
        ([{"text": "a", "token_ids": [1], "logprobs": {"token_logprobs": [-0.1]}}], "index None"),
        (None, "no choices list"),
    ],
)
def test_malformed_batched_answer_is_a_rollout_error(choices: list | None, match: str) -> None:
    """A vLLM answer with too few choices, an index outside the batch, or no choices names the version."""
    import asyncio

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={} if choices is None else {"choices": choices})

    engine = VLLMEngine("http://vllm.test")
    batch = [
        RolloutRequest(version="base", prompt_id=f"p{i}", prompt_token_ids=(1, 2, i), n=1, max_new_tokens=1)
        for i in range(2)
    ]

    async def call() -> None:
        async with httpx.AsyncClient(base_url=engine.url, transport=httpx.MockTransport(handler)) as client:
            await engine._batch(client, batch)

    with pytest.raises(RolloutError, match=match) as info:
        asyncio.run(call())
    assert "'base'" in str(info.value)


def test_batches_group_only_requests_that_differ_in_their_prompt() -> None:
    """Same version/n/length/temperature share a call (at most max_prompts_per_request); any other
    difference, or a sent seed, splits them; first-seen order."""
    engine = VLLMEngine("http://vllm.test", max_prompts_per_request=2)

    def req(version: str, i: int, **kw) -> RolloutRequest:
        return RolloutRequest(version=version, prompt_id=f"p{i}", prompt_token_ids=(i,), n=1, max_new_tokens=4, **kw)

    requests = [req("a", 0), req("b", 1), req("a", 2), req("a", 3), req("a", 4, temperature=0.0), req("a", 5, seed=9)]
    assert engine.batches(requests) == [[0, 2], [3, 5], [1], [4]]
    seeded = VLLMEngine("http://vllm.test", max_prompts_per_request=2, per_request_seed=True)
    assert seeded.batches(requests) == [[0, 2], [3], [1], [4], [5]]
    with pytest.raises(ValueError, match="max_prompts_per_request"):
        VLLMEngine("http://vllm.test", max_prompts_per_request=0)
