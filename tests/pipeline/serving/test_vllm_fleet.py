"""A fleet of two real vLLM replicas (tiny model) that share no disk with the service.

Each replica runs the Hourglass LoRA resolver plugin (pipeline.serving.lora_resolver,
found through a ``vllm.general_plugins`` entry point) with its own cache
folder; the service and the trainer publish adapters to a shared store and
never hand a replica a path of theirs.

- rollouts: each candidate's versions live on one replica (round-robin), the
  requests of one generate call go to the right replica, unloads clean up;
- serving: the champion reaches both replicas through the share, and a replica
  that lost its adapters and its cache (as after a restart) is brought back by
  reconcile;
- a round on Ray trainer actors (``rl.executor = "ray"``) rolls out on both
  replicas, scores a candidate with the round's reward model on its actor, and
  registers its winner and its reward model. (A real restart on the same port, with path loads, is
  tests/pipeline/serving/test_serving_restart.py.)
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient
from prometheus_client.parser import text_string_to_metric_families
from tests.pipeline.round_fakes import FixedSnapshot
from tests.pipeline.serving_helpers import make_adapter, make_config, make_round
from tests.trainer.ray_helpers import until_clean

from connectors.gateway.routes import read_routes
from pipeline.registry.aliases import TAG_SERVE_ERROR, champion_version
from pipeline.registry.client import TAG_ROUND
from pipeline.registry.models import register_round
from pipeline.serving.controller import ServingController
from pipeline.serving.replica import Replica
from pipeline.stack import free_port, vllm_service
from trainer.adapters.share import MANIFEST
from trainer.model.base import load_base
from trainer.config import ModelConfig, RLConfig
from trainer.evaluation.measure import greedy_answers
from trainer.model.store import fingerprint_of
from trainer.plan import PromptTokens
from trainer.types import BASE_VERSION, RolloutRequest
from trainer.rollout.fleet import FleetEngine
from trainer.types import Prompt
from trainer.data import snapshot_table

pytestmark = pytest.mark.integration

ENTRY_POINTS = "[vllm.general_plugins]\nhourglass_lora_resolver = pipeline.serving.lora_resolver:register\n"


def _plugin_path(root: Path) -> Path:
    """A folder whose dist-info declares the resolver entry point (what `pip install .` declares from pyproject)."""
    info = root / "hourglass_fleet_test-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hourglass-fleet-test\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model: Path):
    """Two vLLM replicas with the resolver plugin; yields (urls, share dir, [cache dirs])."""
    root = tmp_path_factory.mktemp("fleet")
    share = root / "share"
    share.mkdir()
    plugins = _plugin_path(root / "plugins")
    pythonpath = os.pathsep.join(p for p in (str(plugins), os.environ.get("PYTHONPATH", "")) if p)
    services, caches = [], []
    for i in range(2):
        cache = root / f"cache-{i}"
        service = vllm_service(
            tiny_model,
            "127.0.0.1",
            free_port(),
            root / f"logs-{i}",
            max_model_len=512,
            max_lora_rank=16,
            startup_timeout_s=900,
        )
        service.env.update(
            {"HOURGLASS_ADAPTER_SHARE": str(share), "HOURGLASS_ADAPTER_CACHE": str(cache), "PYTHONPATH": pythonpath}
        )
        services.append(service)
        caches.append(cache)
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once: each start is mostly waiting on a shared CPU
            for future in [pool.submit(s.start) for s in services]:
                future.result()
        yield [f"http://127.0.0.1:{s.port}" for s in services], share, caches
    finally:
        for service in services:
            service.stop()


def _models(url: str) -> set[str]:
    return set(Replica(url).models())


def test_rollouts_keep_each_candidate_on_one_replica(fleet, tiny_model: Path, tmp_path):
    urls, share, caches = fleet
    engine = FleetEngine(urls, adapter_share=str(share))
    a = make_adapter(tiny_model, tmp_path / "a", seed=1)
    b = make_adapter(tiny_model, tmp_path / "b", seed=2)
    engine.load("cand-a", "cand-a-s0", a)
    engine.load("cand-b", "cand-b-s0", b)
    assert engine.placement() == {"cand-a-s0": urls[0], "cand-b-s0": urls[1]}
    # each version was fetched by its own replica only, from the share, into that replica's cache
    assert "cand-a-s0" in _models(urls[0]) and "cand-a-s0" not in _models(urls[1])
    assert "cand-b-s0" in _models(urls[1]) and "cand-b-s0" not in _models(urls[0])
    assert (caches[0] / "cand-a-s0" / "adapter_model.safetensors").is_file()
    assert (share / "cand-b-s0" / MANIFEST).is_file()

    ids = (1, 2, 3, 4)
    requests = [
        RolloutRequest("cand-b-s0", "p1", ids, n=2, max_new_tokens=3),
        RolloutRequest("cand-a-s0", "p1", ids, n=2, max_new_tokens=3),
        RolloutRequest("base", "p2", ids, n=1, max_new_tokens=3),
        RolloutRequest("cand-b-s0", "p2", ids, n=1, max_new_tokens=3),
    ]
    groups = engine.generate(requests)
    assert [len(g) for g in groups] == [2, 2, 1, 1]
    assert [{s.adapter_version for s in g} for g in groups] == [{"cand-b-s0"}, {"cand-a-s0"}, {"base"}, {"cand-b-s0"}]
    assert all(len(s.token_ids) == len(s.logprobs) > 0 for g in groups for s in g)

    # a new step's version of cand-a lands on cand-a's replica; the old one is unloaded there and leaves the share
    engine.load("cand-a", "cand-a-s1", a)
    engine.unload("cand-a-s0")
    assert "cand-a-s1" in _models(urls[0]) and "cand-a-s0" not in _models(urls[0])
    assert not (share / "cand-a-s0").exists()
    for version in list(engine.versions):
        engine.unload(version)
    assert not {"cand-a-s1", "cand-b-s0"} & (_models(urls[0]) | _models(urls[1]))


def test_champion_reaches_every_replica_through_the_share(fleet, tiny_model: Path, tmp_path, mlflow_uri):
    urls, share, caches = fleet
    model = "srv-fleet"
    fp = fingerprint_of(tiny_model)
    base = make_config(tmp_path, mlflow_uri, urls, experiment="fleet-share")
    cfg = base.model_copy(update={"serving": base.serving.model_copy(update={"adapter_share_uri": str(share)})})
    [v1] = register_round(
        cfg, make_round(make_adapter(tiny_model, tmp_path / "a", seed=7), fp, round_id="r-1", model=model), promote=True
    )
    name = f"{model}-v{v1.version}"
    controller = ServingController(cfg, models=[model], base_fingerprint=fp)
    try:
        controller.reconcile_once()
        assert read_routes(cfg.state_dir)[model].served_name == name
        for url, cache in zip(urls, caches, strict=True):
            assert name in _models(url)
            # the replica loaded its own fetched copy, not the service's staging folder
            assert (cache / name / "adapter_model.safetensors").is_file()
        assert not str(caches[0]).startswith(str(cfg.resolve(cfg.serving.staging_dir)))

        # replica 2 loses its runtime adapters and its cache (a restart): reconcile brings it back from the share
        Replica(urls[1]).unload(name)
        shutil.rmtree(caches[1] / name)
        assert name not in _models(urls[1])
        controller.reconcile_once()
        assert name in _models(urls[1])
        body = {"model": name, "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(f"{urls[1]}/v1/completions", json=body, timeout=30).json()["model"] == name
        assert controller.status()[model]["last_error"] is None
    finally:
        controller.close()
        for url in urls:
            Replica(url).unload(name)


def test_a_replica_that_cannot_fetch_is_a_transient_problem_not_the_adapters(
    fleet, tiny_model: Path, tmp_path, mlflow_uri
):
    urls, share, _ = fleet
    model = "srv-fleet-miss"
    fp = fingerprint_of(tiny_model)
    base = make_config(
        tmp_path, mlflow_uri, urls, experiment="fleet-miss"
    )  # its own rounds (round ids are per experiment)
    elsewhere = tmp_path / "elsewhere"  # the service publishes here; the replicas read `share`
    cfg = base.model_copy(update={"serving": base.serving.model_copy(update={"adapter_share_uri": str(elsewhere)})})
    [v1] = register_round(
        cfg,
        make_round(make_adapter(tiny_model, tmp_path / "a", seed=9), fp, round_id="r-miss", model=model),
        promote=True,
    )
    controller = ServingController(cfg, models=[model], base_fingerprint=fp)
    try:
        st = controller.reconcile_once()[model]
        assert model not in read_routes(cfg.state_dir)  # nothing flipped
        assert st["transient_errors"] == 2 and "did not fetch it" in st["last_transient_error"]
        # the adapter is not blamed: no serve error tag, @champion stays for the next pass
        assert TAG_SERVE_ERROR not in controller.client.get_model_version(model, v1.version).tags
        assert champion_version(controller.client, model, cfg.registry.champion_alias) == v1.version
    finally:
        controller.close()


def test_a_version_missing_from_the_share_is_refused_with_the_reason(fleet, tiny_model: Path, tmp_path):
    urls, share, _ = fleet
    # a replica asked for a name nobody published answers 404; the engine says so instead of sampling the base
    engine = FleetEngine(urls, adapter_share=str(share))
    with pytest.raises(Exception, match="does not exist"):
        engine.engines[0]._post("/v1/completions", {"model": "never-published-s0", "prompt": "Hi", "max_tokens": 1})
    # a corrupted shared copy (checksum mismatch) is not loaded either
    a = make_adapter(tiny_model, tmp_path / "a", seed=3)
    from trainer.adapters.share import publish

    publish(a, str(share), "torn-s0")
    (share / "torn-s0" / "adapter_model.safetensors").write_bytes(b"not the published bytes")
    response = httpx.post(
        f"{urls[1]}/v1/completions", json={"model": "torn-s0", "prompt": "Hi", "max_tokens": 1}, timeout=30
    )
    assert response.status_code == 404 and "torn-s0" not in _models(urls[1])


def test_rounds_roll_out_over_every_serving_replica_unless_told_otherwise(tmp_path) -> None:
    from pipeline.config import HourglassConfig

    fleet = ["http://vllm-0:8000", "http://vllm-1:8000"]
    rl = HourglassConfig(state_dir=str(tmp_path), serving={"replicas": fleet, "adapter_share_uri": "s3://b/share"}).rl
    assert rl.rollout.urls == fleet and rl.rollout.url == fleet[0] and rl.rollout.adapter_share_uri == "s3://b/share"
    own = HourglassConfig(
        state_dir=str(tmp_path), serving={"replicas": fleet}, rl={"rollout": {"url": "http://rollouts:8000"}}
    ).rl
    assert own.rollout.urls == [] and own.rollout.adapter_share_uri is None  # a separate rollout server is used alone
    hf = HourglassConfig(state_dir=str(tmp_path), serving={"replicas": fleet}, rl={"rollout": {"engine": "hf"}}).rl
    assert hf.rollout.urls == [] and hf.rollout.url is None


def _completion_requests(url: str) -> float:
    """``POST /v1/completions`` requests a replica answered, from its own ``/metrics``: the HTTP counter
    ``http_requests_total{handler="/v1/completions"}`` (the test servers run with ``--disable-log-stats``,
    which leaves out vLLM's engine counters)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "http_requests"
        for sample in family.samples
        if sample.name == "http_requests_total" and sample.labels.get("handler") == "/v1/completions"
    )


def _rows_with_base_answers(tiny_model: Path, urls: list[str], rl: RLConfig) -> list[Prompt]:
    """Served answers with thumbs (for the reward model), each row carrying the base model's greedy
    answer (``base_answer``), asked of the fleet the way the round's evaluation asks it."""
    words = "apple river stone cloud green seven table music light paper".split()
    rows = [
        Prompt(
            prompt_id=f"f{i:03d}",
            messages=[{"role": "user", "content": f"Say a few words about thing {i}."}],
            logged_completion=" ".join([words[i % 10], words[(i * 3) % 10], "banana" if i % 2 == 0 else words[i % 7]]),
            logged_reward=1.0 if i % 2 == 0 else -1.0,
        )
        for i in range(24)
    ]
    ids = PromptTokens(load_base(ModelConfig(name=str(tiny_model))), rl).many(rows)
    answers = greedy_answers(FleetEngine(urls), [BASE_VERSION], rows, ids, rl)[BASE_VERSION]
    return [dataclasses.replace(r, metadata={"base_answer": a.text}) for r, a in zip(rows, answers, strict=True)]


def test_a_ray_round_rolls_out_on_every_replica_and_registers_its_winner(
    fleet, ray_cluster, tiny_model: Path, tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.config import HourglassConfig
    from pipeline.registry.reward_registry import reward_model_name
    from pipeline.rounds import job as round_job

    urls, share, _ = fleet
    name = f"ray-fleet-{uuid.uuid4().hex[:8]}"
    rl = {
        "steps_per_round": 2,
        "prompts_per_step": 2,
        "rollout": {"group_size": 4, "max_new_tokens": 4, "engine": "vllm"},  # urls: every serving replica
        "gate": {
            "eval_prompts": 4,
            "max_kl": 100.0,
            "bootstrap_samples": 100,
            # the yardstick: "differs from the base's greedy answer", which any trained candidate passes on a
            # random model, so the round has a winner to register (this test is about where the work runs)
            "reward": [{"fn": "tests.trainer.ray_helpers:unlike_base"}],
        },
        "executor": "ray",
        "ray": {"actors": 2, "storage_uri": f"file://{tmp_path / 'exchange'}"},
    }
    cfg = HourglassConfig(
        state_dir=str(tmp_path / "state"),
        registry={"tracking_uri": mlflow_uri, "experiment": name, "embedded": False},
        serving={
            "model_name": name,
            "replicas": urls,
            "embedded": False,
            "staging_dir": str(tmp_path / "staging"),
            "max_lora_rank": 16,
            "adapter_share_uri": str(share),
            "canary": {"enabled": False},
        },
        model={"name": str(tiny_model)},
        candidates=[
            {
                "name": "c0",
                "start": "fresh",
                "learning_rate": 5e-2,
                "kl_coef": 0.0,
                "reward": [{"fn": "tests.trainer.ray_helpers:longer"}],
            },
            {
                "name": "c1",
                "start": "fresh",
                "learning_rate": 5e-2,
                "kl_coef": 0.0,
                "reward": [{"fn": "reward_model", "kwargs": {"probability": False}}],
            },
        ],
        rl=rl | {"reward_model": {"steps": 4, "batch_size": 8, "min_examples": 8, "start": "fresh"}},
        schedule={"enabled": False},
    )
    assert cfg.rl.rollout.urls == urls and cfg.rl.rollout.adapter_share_uri == str(share)
    table = snapshot_table(_rows_with_base_answers(tiny_model, urls, cfg.rl))

    before = [_completion_requests(u) for u in urls]
    record = round_job.RoundRunner(
        cfg, fingerprint_of(tiny_model), steps=FixedSnapshot(cfg, fingerprint_of(tiny_model), table)
    ).run("manual")
    after = [_completion_requests(u) for u in urls]

    assert record.state == "done", record.reason
    assert record.metrics["executor/actors"] == 2.0
    # one candidate per actor; candidate i rolls out on replica i whichever actor trains it (2 steps x 2 prompts each)
    served = [record.metrics.get(f"rollout/replica{j}/requests", 0.0) for j in range(2)]
    assert served == [4.0, 4.0], record.metrics
    # the replica's own count agrees: a step's 2 prompts of a candidate travel as one batched call (2 calls for its
    # 4 requests), and it also answered load probes and evaluation
    for j, url in enumerate(urls):
        assert after[j] - before[j] >= served[j] / 2, (url, before, after)
    client = MlflowClient(mlflow_uri)
    assert champion_version(client, name, "champion") == record.versions[name]  # the winner, registered and promoted
    assert record.metrics["reward_model/version"] == 1.0  # the round's reward model, registered like a local round's
    [rm_version] = client.search_model_versions(f"name = '{reward_model_name(cfg)}'")
    assert rm_version.tags[TAG_ROUND] == record.round_id
    assert until_clean() == ([], [])
