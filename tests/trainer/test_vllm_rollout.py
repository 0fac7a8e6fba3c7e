"""The vLLM rollout engine against a real vLLM CPU server (``vllm_tiny``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from trainer.adapter_store import make_store
from trainer.base import load_base
from trainer.config import CandidateConfig, ModelConfig
from trainer.errors import RolloutError
from trainer.rollout import RolloutRequest
from trainer.rollout_vllm import VLLMEngine

pytestmark = pytest.mark.integration


class RecordingEngine(VLLMEngine):
    """Records when each completion request starts and ends (event order only)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
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

        # all four requests were sent before the first answer came back
        first_end = next(i for i, e in enumerate(engine.events) if e.startswith("end:"))
        assert sum(e.startswith("start:") for e in engine.events[:first_end]) == 4
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
