"""The vLLM fixture serves completions and hot-loads a LoRA adapter at runtime."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.integration

PROMPT = "The capital of France is"


def _greedy(base_url: str, model: str) -> str:
    response = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "seed": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _random_lora(model_dir: Path, out: Path) -> Path:
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # make the adapter's effect large on a random model
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(50.0)
    peft_model.save_pretrained(out)
    assert (out / "adapter_model.safetensors").is_file()
    return out


def test_runtime_lora_load_changes_the_output(vllm_tiny: str, tiny_model: Path, tmp_path: Path) -> None:
    before = _greedy(vllm_tiny, "base")
    assert before == _greedy(vllm_tiny, "base")  # greedy is deterministic

    adapter = _random_lora(tiny_model, tmp_path / "adapter")
    load = httpx.post(
        f"{vllm_tiny}/v1/load_lora_adapter", json={"lora_name": "probe-v1", "lora_path": str(adapter)}, timeout=120
    )
    assert load.status_code == 200, load.text
    served = {m["id"] for m in httpx.get(f"{vllm_tiny}/v1/models", timeout=30).json()["data"]}
    assert {"base", "probe-v1"} <= served

    with_adapter = _greedy(vllm_tiny, "probe-v1")
    assert with_adapter != before
    assert _greedy(vllm_tiny, "base") == before  # the base is untouched

    unload = httpx.post(f"{vllm_tiny}/v1/unload_lora_adapter", json={"lora_name": "probe-v1"}, timeout=60)
    assert unload.status_code == 200, unload.text
    served = {m["id"] for m in httpx.get(f"{vllm_tiny}/v1/models", timeout=30).json()["data"]}
    assert "probe-v1" not in served
