"""Hot-load latency: time from an ``@champion`` alias move to the first completion
served by the new version through the public route.

Two paths, measured side by side in one run, alternating, on the same MLflow
and vLLM (a fresh MLflow + vLLM on the tiny random Llama are started here
unless --mlflow-uri and --vllm-url are given):

- ``external``: someone moves the alias with the plain MLflow client; the
  controller's reconcile loop (``--interval-s``) notices it;
- ``promote``: :func:`pipeline.registry.aliases.promote` then ``controller.trigger()``
  (what the ops API does).

Every promotion loads a version that is not loaded and not staged (the staged
copy is removed first), so each sample includes download, checksum checks,
load and probe. The clock stops at the first ``/v1/completions`` through the
route that is answered by the new versioned name. Prints p50 / p95 per path,
the ratio external/promote of the p50s, and, as the last line, the p95 of the
external path in seconds (target < 2 s).

    python bench/hotload.py [--promotions 10] [--interval-s 0.25] [--mlflow-uri URI --vllm-url URL]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "pipeline"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlflow.tracking import MlflowClient  # noqa: E402

from bench import writer  # noqa: E402

from pipeline.registry import aliases  # noqa: E402
from pipeline.registry.models import register_round  # noqa: E402
from pipeline.serving.replica import Replica  # noqa: E402
from pipeline.serving.controller import ServingController  # noqa: E402
from connectors.gateway.routes import read_routes  # noqa: E402
from pipeline.stack import free_port, mlflow_service, vllm_service  # noqa: E402
from serving_helpers import make_adapter, make_config, make_round  # noqa: E402
from trainer.model import store as model_store  # noqa: E402

MODEL = "bench-hotload"
CACHE = Path(os.environ.get("HOURGLASS_MODEL_CACHE", "~/.cache/hourglass/models")).expanduser()


def _first_new_completion(state_dir: Path, http: httpx.Client, want: str, timeout_s: float = 60.0) -> float:
    """Poll the route + a 1-token completion until ``want`` answers; returns time.monotonic() then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        route = read_routes(state_dir).get(MODEL)
        if route is not None and route.served_name == want:
            body = {"model": route.served_name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
            response = http.post("/v1/completions", json=body)
            if response.status_code == 200 and response.json().get("model") == want:
                return time.monotonic()
        time.sleep(0.01)
    raise TimeoutError(f"{want} was not served within {timeout_s}s")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(
    mlflow_uri: str, vllm_url: str, work: Path, promotions: int, interval_s: float, recorder: writer.Recorder
) -> float:
    tiny = model_store.build_tiny_llama(
        CACHE / "tiny-random-llama", tokenizer_from=CACHE / "smollm2-135m-instruct"
    ).path
    fp = model_store.fingerprint_of(tiny)
    cfg = make_config(work, mlflow_uri, [vllm_url], interval_s=interval_s, drain_s=0.2, experiment="bench-hotload")
    versions = []
    for i in range(4):  # reused round-robin; each is unloaded and unstaged before it is promoted again
        adapter = make_adapter(tiny, work / f"adapter-{i}", seed=100 + i)
        versions += [
            v.version
            for v in register_round(cfg, make_round(adapter, fp, round_id=f"bench-{time.time_ns()}-{i}", model=MODEL))
        ]
    client = MlflowClient(mlflow_uri)
    aliases.promote(cfg, MODEL, versions[0], client=client)
    controller = ServingController(cfg, models=[MODEL], base_fingerprint=fp, client=client)
    controller.start()
    replica = Replica(vllm_url)
    http = httpx.Client(base_url=vllm_url, timeout=30)
    samples: dict[str, list[float]] = {"external": [], "promote": []}
    loads: list[float] = []
    try:
        _first_new_completion(cfg.resolve(cfg.state_dir), http, f"{MODEL}-v{versions[0]}")
        for i in range(2 * promotions):
            mode = "external" if i % 2 == 0 else "promote"
            target = versions[(i + 1) % len(versions)]
            name = f"{MODEL}-v{target}"
            while name in replica.models():  # wait for the drain of an earlier use
                time.sleep(0.05)
            shutil.rmtree(cfg.staging_root() / MODEL / f"v{target}", ignore_errors=True)
            started = time.monotonic()
            if mode == "external":
                client.set_registered_model_alias(MODEL, cfg.registry.champion_alias, target)
            else:
                aliases.promote(cfg, MODEL, target, client=client, reason="bench")
                controller.trigger()
            done = _first_new_completion(cfg.resolve(cfg.state_dir), http, name)
            samples[mode].append(done - started)
            loads.append(controller.status()[MODEL]["last_hotload_s"] or 0.0)
    finally:
        controller.close()
        for name in replica.models():
            if name.startswith(f"{MODEL}-v"):
                replica.unload(name)
        http.close()
    for mode, values in samples.items():
        print(
            f"{mode:>8}: n={len(values)} p50={statistics.median(values):.3f}s p95={_pct(values, 0.95):.3f}s "
            f"max={max(values):.3f}s"
        )
    print(f"stage+load+probe inside the controller: p50={statistics.median(loads):.3f}s p95={_pct(loads, 0.95):.3f}s")
    print(
        f"ratio external/promote (p50): {statistics.median(samples['external']) / statistics.median(samples['promote']):.2f} "
        f"(reconcile interval {interval_s}s)"
    )
    p95 = _pct(samples["external"], 0.95)
    rows = [
        [
            f"`{mode}`",
            len(values),
            f"{statistics.median(values):.3f} s",
            f"{_pct(values, 0.95):.3f} s",
            f"{max(values):.3f} s",
        ]
        for mode, values in samples.items()
    ]
    rows.append(
        [
            "stage + load + probe (inside the controller)",
            len(loads),
            f"{statistics.median(loads):.3f} s",
            f"{_pct(loads, 0.95):.3f} s",
            f"{max(loads):.3f} s",
        ]
    )
    recorder.write(
        "tiny",
        title=f"{promotions} promotions per path, tiny random Llama, reconcile interval {interval_s} s",
        columns=["path", "promotions", "p50", "p95", "max"],
        rows=rows,
        result=f"p95 alias move -> first completion by the new version (external path): **{p95:.3f} s** (target < 2 s)",
    )
    print(f"p95 alias move -> first completion by the new version (external path), seconds; target < 2: {p95:.3f}")
    print(f"{p95:.3f}")
    return p95


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--promotions", type=int, default=10, help="Promotions per path.")
    parser.add_argument("--interval-s", type=float, default=0.25, help="Reconcile loop interval.")
    parser.add_argument("--mlflow-uri", help="Use this MLflow instead of starting one.")
    parser.add_argument("--vllm-url", help="Use this vLLM (tiny model, --enable-lora) instead of starting one.")
    writer.add_arguments(parser)
    args = parser.parse_args()
    recorder = writer.Recorder("hotload", args)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="hourglass-bench-") as tmp:
        work = Path(tmp)
        services = []
        # Startup order: MLflow, then vLLM; shutdown in reverse (finally below).
        try:
            mlflow_uri, vllm_url = args.mlflow_uri, args.vllm_url
            if mlflow_uri is None:
                services.append(mlflow_service("127.0.0.1", free_port(), work / "mlflow", work / "logs"))
                services[-1].start()
                mlflow_uri = f"http://127.0.0.1:{services[-1].port}"
            if vllm_url is None:
                tiny = model_store.build_tiny_llama(
                    CACHE / "tiny-random-llama", tokenizer_from=CACHE / "smollm2-135m-instruct"
                ).path
                services.append(vllm_service(tiny, "127.0.0.1", free_port(), work / "logs", max_model_len=512))
                services[-1].start()
                vllm_url = f"http://127.0.0.1:{services[-1].port}"
            run(mlflow_uri, vllm_url, work, args.promotions, args.interval_s, recorder)
        finally:
            for service in reversed(services):
                service.stop()


if __name__ == "__main__":
    main()
