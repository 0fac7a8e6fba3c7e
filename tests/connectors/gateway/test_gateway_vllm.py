"""Against a real vLLM (tiny model): refused requests never reach vLLM (its own request counter
does not move), while an allowed one does. The hang-up abort is proven with a recording fake
upstream in test_gateway_attacks.py (the test vLLM runs with --disable-log-stats: no engine metrics)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from connectors.gateway.auth import KeyStore
from connectors.config import KafkaConfig
from connectors.gateway.app import create_gateway_app
from tests.connectors.gateway.gateway_fakes import FakeSink, serve, wait_for

BODY = {"model": "hourglass", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 2}


def vllm_chat_requests(url: str) -> float:
    """Chat requests vLLM's HTTP server has answered (any status), from its ``http_requests_total``."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "http_requests_total" and sample.labels.get("handler") == "/v1/chat/completions":
                total += sample.value
    return total


@pytest.fixture(scope="module")
def setup(vllm_tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    keys = KeyStore(tmp_path_factory.mktemp("keys") / "gateway-keys.json")
    _, key = keys.create("client")
    app = create_gateway_app(
        KafkaConfig(bootstrap_servers=["127.0.0.1:9"]), vllm_tiny, lambda n: ("base", None), sink=FakeSink(), keys=keys
    )
    with serve(app) as url:
        yield url, key


@pytest.mark.integration
@pytest.mark.parametrize(
    "extra",
    [
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"prompt_embeds": "AAAA"},
        {"n": 100_000},
        {"max_tokens": 10**9},
        {"chat_template": "{{ raise('x') }}"},
    ],
)
def test_refused_requests_never_reach_vllm(setup: tuple[str, str], vllm_tiny: str, extra: dict) -> None:
    gateway, key = setup
    headers = {"authorization": f"Bearer {key}"}
    before = vllm_chat_requests(vllm_tiny)
    bad = httpx.post(f"{gateway}/v1/chat/completions", json={**BODY, **extra}, headers=headers, timeout=60)
    assert bad.status_code == 400, bad.text
    good = httpx.post(f"{gateway}/v1/chat/completions", json=BODY, headers=headers, timeout=60)
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] is not None
    wait_for(lambda: vllm_chat_requests(vllm_tiny) >= before + 1, 10, "vLLM to count the allowed request")
    assert vllm_chat_requests(vllm_tiny) == before + 1, "only the allowed request reached vLLM"
