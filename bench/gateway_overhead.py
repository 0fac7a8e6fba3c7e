"""Gateway overhead: chat latency through the gateway (trace published to Kafka) vs straight to vLLM.

Same vLLM server (tiny random Llama, started here unless --upstream is given),
same broker (a fresh Tansu unless --bootstrap is given), same request
(``max_tokens`` tokens, ``ignore_eos``); direct and gateway requests alternate
so load drifts hit both sides alike. Reports median latency per side, for plain
and streamed requests, and checks that every gateway request's trace was
acknowledged by the broker. Last line: the ratio gateway / direct of the
median plain-request latency (target <= 1.10).

    python bench/gateway_overhead.py [--requests 60] [--max-tokens 16] [--upstream URL] [--bootstrap HOST:PORT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402

from bench import writer  # noqa: E402
from connectors.gateway.auth import KeyStore  # noqa: E402
from connectors.config import GatewayConfig, KafkaConfig  # noqa: E402
from connectors.edge import server_config  # noqa: E402
from connectors.gateway.app import create_gateway_app, edge_limits  # noqa: E402
from connectors.kafka_admin import ensure_topics  # noqa: E402
from pipeline.stack import broker_service, free_port, vllm_service  # noqa: E402
from trainer.model import store as model_store  # noqa: E402

MODEL_CACHE = Path(os.environ.get("HOURGLASS_MODEL_CACHE", "~/.cache/hourglass/models")).expanduser()


def _acked() -> float:
    return REGISTRY.get_sample_value("hourglass_gateway_traces_acked_total") or 0.0


def _timed(client: httpx.Client, url: str, body: dict, stream: bool) -> float:
    start = time.perf_counter()
    if stream:
        with client.stream("POST", url, json={**body, "stream": True}) as response:
            response.raise_for_status()
            for _ in response.iter_lines():
                pass
    else:
        client.post(url, json=body).raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="Requests per side and mode.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--upstream", help="vLLM base URL serving model 'base' (default: start one).")
    parser.add_argument("--bootstrap", help="Kafka host:port (default: start a Tansu broker).")
    writer.add_arguments(parser)
    args = parser.parse_args()
    recorder = writer.Recorder("gateway-overhead", args)

    services = []
    logs = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    try:
        bootstrap, upstream = args.bootstrap, args.upstream
        if bootstrap is None:
            services.append(broker_service("127.0.0.1", free_port(), logs))
            services[-1].start()
            bootstrap = f"127.0.0.1:{services[-1].port}"
        if upstream is None:
            smol = model_store.pull("smollm2-135m-instruct", MODEL_CACHE).path
            tiny = model_store.build_tiny_llama(MODEL_CACHE / "tiny-random-llama", tokenizer_from=smol).path
            services.append(vllm_service(tiny, "127.0.0.1", free_port(), logs, max_model_len=512))
            services[-1].start()
            upstream = f"http://127.0.0.1:{services[-1].port}"
        tag = uuid.uuid4().hex[:8]
        kafka = KafkaConfig(
            bootstrap_servers=[bootstrap], traces_topic=f"bench-traces-{tag}", feedback_topic=f"bench-fb-{tag}"
        )
        ensure_topics(kafka)

        port = free_port()
        keys = KeyStore(logs / "gateway-keys.json")  # the gateway authenticates every request, as in production
        _, key = keys.create("bench", rate_per_min=1_000_000)
        app = create_gateway_app(kafka, upstream, lambda name: ("base", None), keys=keys)
        # served as `hourglass gateway` serves it: uvicorn + h11 behind the request-head limits (connectors/edge.py)
        server = uvicorn.Server(
            server_config(app, "127.0.0.1", port, edge_limits(GatewayConfig()), log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        gateway = f"http://127.0.0.1:{port}"

        body = {
            "messages": [{"role": "user", "content": "What is 2+2?"}],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
        }
        acked_before = _acked()
        results: dict[tuple[str, bool], list[float]] = {}
        with httpx.Client(timeout=120, headers={"authorization": f"Bearer {key}"}) as client:
            for stream in (False, True):
                for _ in range(3):  # warm-up, both sides
                    _timed(client, f"{upstream}/v1/chat/completions", {**body, "model": "base"}, stream)
                    _timed(client, f"{gateway}/v1/chat/completions", {**body, "model": "hourglass"}, stream)
                for _ in range(args.requests):
                    for side, url, model in (("direct", upstream, "base"), ("gateway", gateway, "hourglass")):
                        latency = _timed(client, f"{url}/v1/chat/completions", {**body, "model": model}, stream)
                        results.setdefault((side, stream), []).append(latency)
        deadline = time.monotonic() + 30
        expected = 2 * (args.requests + 3)
        while _acked() - acked_before < expected and time.monotonic() < deadline:
            time.sleep(0.1)
        acked = int(_acked() - acked_before)
        server.should_exit = True
        thread.join(timeout=60)

        print(f"requests per side and mode: {args.requests}, max_tokens: {args.max_tokens}, upstream: {upstream}")
        print(f"traces acknowledged by the broker: {acked} / {expected}")
        rows = []
        for stream in (False, True):
            direct = statistics.median(results[("direct", stream)]) * 1000
            via = statistics.median(results[("gateway", stream)]) * 1000
            mode = "stream" if stream else "plain"
            print(f"{mode:6s} median latency ms: direct {direct:8.2f}  gateway {via:8.2f}  ratio {via / direct:.3f}")
            rows.append([mode, f"{direct:.2f} ms", f"{via:.2f} ms", f"{via / direct:.3f}"])
        plain = statistics.median(results[("gateway", False)]) / statistics.median(results[("direct", False)])
        recorder.write(
            "tiny",
            title=f"{args.requests} chat requests per side and mode, {args.max_tokens} tokens, tiny random Llama",
            columns=["mode", "direct to vLLM, median", "through the gateway, median", "gateway / direct"],
            rows=rows,
            result=f"gateway / direct median latency (plain): **{plain:.3f}** (target <= 1.10)",
            notes=[f"traces acknowledged by the broker: {acked} / {expected}"],
        )
        print(f"gateway/direct median latency ratio (plain): {plain:.3f}")
    finally:
        # Shutdown order: 1. gateway (above, flushes traces), 2. vLLM, 3. broker (reverse start order).
        for service in reversed(services):
            service.stop()


if __name__ == "__main__":
    main()
