"""Production deployment files in ``deploy/``: they parse, name the right
services and flags, and agree with ``deploy/production.toml``.

Docker is not available on the dev machine, so ``deploy/compose.yaml`` is
checked structurally here (and cross-checked against the config it mounts),
never run. The systemd units are read as INI files and, where
``systemd-analyze`` exists, verified by systemd itself.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli.main import app
from pipeline.config import HourglassConfig, load_config
from tests import REPO

DEPLOY = REPO / "deploy"
CONFIG_IN_CONTAINER = "/etc/hourglass/hourglass.toml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def prod() -> HourglassConfig:
    return load_config(DEPLOY / "production.toml")


def _flag(argv: list[str], name: str) -> str:
    """The value after ``name`` in an argv list."""
    assert name in argv, f"{name} missing from {argv}"
    return str(argv[argv.index(name) + 1])


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> 'source[:mode]' of a compose service's short-syntax volumes."""
    out = {}
    for spec in service.get("volumes", []):
        source, target, *mode = spec.split(":")
        out[target] = ":".join([source, *mode])
    return out


# --- configs ----------------------------------------------------------------------------


REAL_SECRETS = {
    "HOURGLASS_API__TOKEN": "0f" * 16,
    "HOURGLASS_BUFFER__USER_HASH_KEY": "1e" * 16,
    "HOURGLASS_REGISTRY__SIGNING_KEY": "2d" * 16,
    "HOURGLASS_KAFKA__ROUTES_SIGNING_KEY": "3c" * 16,
}


@pytest.mark.parametrize("name", ["production.toml", "hourglass.toml"])
def test_shipped_configs_pass_config_check(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in REAL_SECRETS.items():  # production.toml needs real secrets in the environment
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(app, ["config", "check", str(DEPLOY / name), "--json"])
    assert result.exit_code == 0, result.output
    assert '"ok": true' in result.output


def test_embedded_default_needs_no_secret() -> None:
    result = CliRunner().invoke(app, ["config", "check", str(DEPLOY / "hourglass.toml"), "--json"])
    assert result.exit_code == 0, result.output


def test_production_config_without_secrets_or_with_the_placeholders_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(app, ["config", "check", str(DEPLOY / "production.toml"), "--json"])
    assert result.exit_code == 2
    assert "buffer.user_hash_key" in result.output and "registry.signing_key" in result.output
    assert "not set" in result.output  # the signing key is required in production
    assert "kafka.routes_signing_key" in result.output  # routes_source = "kafka" needs signed route records
    for key, value in _env_example("hourglass.env.example"):
        monkeypatch.setenv(key, value)
    # The gateway never gets the signing key: its check does not ask for it.
    result = CliRunner().invoke(
        app, ["config", "check", "--role", "gateway", str(DEPLOY / "production.toml"), "--json"]
    )
    assert result.exit_code == 2 and "registry.signing_key" not in result.output
    assert "api.token" in result.output and "buffer.user_hash_key" in result.output
    assert "kafka.routes_signing_key" in result.output  # gateways verify route records with it
    for key, value in _env_example("signing.env.example"):
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(app, ["config", "check", str(DEPLOY / "production.toml"), "--json"])
    assert result.exit_code == 2
    for field in ("api.token", "buffer.user_hash_key", "registry.signing_key", "kafka.routes_signing_key"):
        assert f"{field} (HOURGLASS_" in result.output and "placeholder" in result.output, field
    assert "change-me" not in result.output  # secrets are never echoed


def test_only_the_service_gets_the_signing_key(
    compose: dict[str, Any], k8s: dict[tuple[str, str], dict[str, Any]]
) -> None:
    services = compose["services"]
    assert [f["path"] for f in services["service"]["env_file"]] == ["hourglass.env", "signing.env"]
    assert [f["path"] for f in services["gateway"]["env_file"]] == ["hourglass.env"]
    assert "HOURGLASS_REGISTRY__SIGNING_KEY" not in (DEPLOY / "hourglass.env.example").read_text()
    assert dict(_env_example("signing.env.example")).keys() == {"HOURGLASS_REGISTRY__SIGNING_KEY"}
    assert _unit("hourglass.service")["Service"]["EnvironmentFile"] == [
        "/etc/hourglass/env",
        "/etc/hourglass/signing.env",
    ]
    gateway_unit = _unit("hourglass-gateway.service")["Service"]
    assert gateway_unit["EnvironmentFile"] == ["/etc/hourglass/env"]
    assert "--role gateway" in gateway_unit["ExecStartPre"][0]
    service_pod = k8s[("Deployment", "hourglass-service")]["spec"]["template"]["spec"]["containers"][0]
    gateway_pod = k8s[("Deployment", "hourglass-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert {"secretRef": {"name": "hourglass-signing"}} in service_pod["envFrom"]
    assert gateway_pod["envFrom"] == [{"secretRef": {"name": "hourglass-secrets"}}]


def test_production_config_uses_only_external_services(prod: HourglassConfig) -> None:
    assert not (prod.kafka.embedded or prod.registry.embedded or prod.serving.embedded)
    assert prod.kafka.bootstrap_servers == ["kafka:9092"]
    assert prod.registry.tracking_uri == "http://mlflow:5000"
    assert prod.serving.replicas == ["http://vllm:8000"]
    assert (prod.model.dtype, prod.model.device) == ("bfloat16", "cuda")
    assert prod.schedule.cron == "0 * * * *" and prod.schedule.enabled
    assert prod.api.host == "0.0.0.0"
    assert prod.api.token is None, "the token comes from HOURGLASS_API__TOKEN, never from the file"
    assert prod.registry.signing_key is None, "the signing key comes from HOURGLASS_REGISTRY__SIGNING_KEY"
    assert prod.deployment == "production"
    assert {"service", "hourglass-ops"} <= set(prod.api.allowed_hosts)  # compose and k8s names of the ops API
    # Everything the service writes lives under the one state volume.
    for path in (prod.buffer.root, prod.buffer.dead_letter_root, prod.serving.staging_dir):
        assert Path(path).is_relative_to(prod.state_dir), path


def _env_example(name: str) -> list[list[str]]:
    return [
        line.split("=", 1)
        for line in (DEPLOY / name).read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def test_env_example_sets_the_secrets_the_config_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = _env_example("hourglass.env.example") + _env_example("signing.env.example")
    for key, value in pairs:
        monkeypatch.setenv(key, value + "-test")
    values = dict(pairs)
    cfg = load_config(DEPLOY / "production.toml")
    assert cfg.api.token is not None and cfg.api.token.get_secret_value() == values["HOURGLASS_API__TOKEN"] + "-test"
    assert cfg.buffer.user_hash_key.get_secret_value() == values["HOURGLASS_BUFFER__USER_HASH_KEY"] + "-test"
    assert cfg.registry.signing_key.get_secret_value() == values["HOURGLASS_REGISTRY__SIGNING_KEY"] + "-test"
    assert cfg.kafka.routes_signing_key is not None
    assert cfg.kafka.routes_signing_key.get_secret_value() == values["HOURGLASS_KAFKA__ROUTES_SIGNING_KEY"] + "-test"


# --- compose ------------------------------------------------------------------------


def test_compose_has_every_service_with_a_restart_policy(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"kafka", "postgres", "mlflow", "vllm", "service", "gateway"} <= set(services)
    for name in ("kafka", "postgres", "mlflow", "vllm", "service", "gateway"):
        assert services[name]["restart"] == "unless-stopped", name
        assert "healthcheck" in services[name], name
    # Named volumes that services use are declared.
    used = {spec.split(":")[0] for s in services.values() for spec in s.get("volumes", []) if not spec.startswith(".")}
    assert used <= set(compose["volumes"]), used - set(compose["volumes"])


def test_ops_api_is_published_on_loopback_only(compose: dict[str, Any], prod: HourglassConfig) -> None:
    ports = compose["services"]["service"]["ports"]
    assert ports == [f"127.0.0.1:{prod.api.port}:{prod.api.port}"]
    gateway_ports = compose["services"]["gateway"]["ports"]
    assert gateway_ports == [f"${{HOURGLASS_GATEWAY_BIND:-127.0.0.1}}:{prod.api.gateway_port}:{prod.api.gateway_port}"]
    assert compose["services"]["grafana"]["ports"] == ["127.0.0.1:3000:3000"]  # the dashboard, loopback only
    for name, service in compose["services"].items():
        if name not in ("service", "gateway", "grafana"):
            assert "ports" not in service, f"{name} must not be published on the host"


def test_vllm_serves_what_the_config_expects(compose: dict[str, Any], prod: HourglassConfig) -> None:
    vllm = compose["services"]["vllm"]
    argv = [str(a) for a in vllm["command"]]
    assert vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" in argv
    assert int(_flag(argv, "--max-lora-rank")) == prod.serving.max_lora_rank == 16
    assert int(_flag(argv, "--max-loras")) == prod.serving.max_loras == 4
    assert int(_flag(argv, "--max-model-len")) == prod.serving.max_model_len
    assert _flag(argv, "--served-model-name") == prod.serving.base_served_name
    assert f"http://vllm:{_flag(argv, '--port')}" == prod.serving.replicas[0]
    assert _flag(argv, "--dtype") == prod.model.dtype
    # The base it serves is the one the trainer resolves from model.cache_dir.
    assert _flag(argv, "--model") == f"{prod.model.cache_dir}/{prod.model.name}"
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_adapter_paths_are_shared_between_service_and_vllm(compose: dict[str, Any], prod: HourglassConfig) -> None:
    # vLLM loads adapters by path: it must mount the service's state at the same place.
    services = compose["services"]
    state = _mounts(services["service"])[prod.state_dir]
    assert _mounts(services["vllm"])[prod.state_dir] == f"{state}:ro"
    assert _mounts(services["gateway"])[prod.state_dir] == f"{state}:ro"  # routes.json
    models = _mounts(services["service"])[prod.model.cache_dir].split(":")[0]
    assert _mounts(services["vllm"])[prod.model.cache_dir] == f"{models}:ro"
    assert _flag(services["model-init"]["command"], "--cache-dir") == prod.model.cache_dir


def test_service_and_gateway_run_the_cli_on_the_mounted_production_config(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, verb in (("service", "service"), ("gateway", "gateway")):
        svc = services[name]
        assert svc["command"] == [verb, "--config", CONFIG_IN_CONTAINER]
        assert _mounts(svc)[CONFIG_IN_CONTAINER] == "./production.toml:ro"
        assert svc["env_file"][0]["path"] == "hourglass.env"
        assert svc["stop_signal"] == "SIGTERM"
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert services["service"]["stop_grace_period"] == "120s"
    for dependency in ("kafka", "mlflow", "vllm"):
        assert services["service"]["depends_on"][dependency]["condition"] == "service_healthy"


def test_mlflow_uses_postgres_and_an_artifact_volume(compose: dict[str, Any]) -> None:
    mlflow = compose["services"]["mlflow"]
    command = " ".join(mlflow["command"])
    assert '--backend-store-uri "postgresql://mlflow:' in command and "@postgres:5432/mlflow" in command
    destination = command.split("--artifacts-destination ")[1].split()[0]
    assert destination in _mounts(mlflow)
    assert "mlflow:5000" in command.split("--allowed-hosts ")[1]  # MLflow 3 rejects unknown Host headers
    assert mlflow["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_kafka_is_single_node_kraft_on_the_configured_address(compose: dict[str, Any], prod: HourglassConfig) -> None:
    env = compose["services"]["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{prod.kafka.bootstrap_servers[0]}"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"  # the service creates its topics
    assert _mounts(compose["services"]["kafka"])[env["KAFKA_LOG_DIRS"]].startswith("kafka-data")


# --- systemd ------------------------------------------------------------------------


def _unit(name: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit as {section: {key: [values in order]}} (keys may repeat, e.g. Environment)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in (DEPLOY / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{name}: {raw!r} is not key=value"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.mark.parametrize(("unit", "verb"), [("hourglass.service", "service"), ("hourglass-gateway.service", "gateway")])
def test_systemd_unit_runs_the_cli_and_stops_cleanly(unit: str, verb: str) -> None:
    sections = _unit(unit)
    service = sections["Service"]
    [exec_start] = service["ExecStart"]
    assert exec_start.split()[0].endswith("/bin/hourglass")
    assert exec_start.split()[1:] == [verb, "--config", CONFIG_IN_CONTAINER]
    assert service["KillSignal"] == ["SIGTERM"]
    assert service["Restart"] == ["on-failure"]
    assert service["EnvironmentFile"][0] == "/etc/hourglass/env"
    assert {"HF_HUB_OFFLINE=1", "HOME=/var/lib/hourglass"} <= set(service["Environment"])
    assert service["User"] == ["hourglass"]
    for key, value in (("NoNewPrivileges", "true"), ("ProtectSystem", "strict"), ("PrivateTmp", "true")):
        assert service[key] == [value], key
    assert sections["Install"]["WantedBy"] == ["multi-user.target"]


def test_service_unit_may_write_only_its_state_and_waits_for_shutdown(prod: HourglassConfig) -> None:
    service = _unit("hourglass.service")["Service"]
    assert service["ReadWritePaths"] == [prod.state_dir]
    assert service["WorkingDirectory"] == [prod.state_dir]
    assert int(service["TimeoutStopSec"][0]) >= 120
    assert "ReadWritePaths" not in _unit("hourglass-gateway.service")["Service"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", ["hourglass.service", "hourglass-gateway.service"])
def test_systemd_accepts_every_directive(unit: str, tmp_path: Path) -> None:
    copy = tmp_path / unit
    copy.write_text((DEPLOY / unit).read_text())
    result = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], check=False, capture_output=True, text=True, timeout=60
    )
    # The venv binary does not exist on this machine; any other complaint is a defect.
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and "is not executable" not in line
    ]
    assert problems == []


# --- kubernetes -------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    docs = yaml.safe_load_all((DEPLOY / "k8s" / "hourglass.yaml").read_text())
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def test_k8s_configmap_is_the_production_config(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    data = k8s[("ConfigMap", "hourglass-config")]["data"]
    assert data == {"hourglass.toml": (DEPLOY / "production.toml").read_text()}


@pytest.mark.parametrize(("name", "verb"), [("hourglass-service", "service"), ("hourglass-gateway", "gateway")])
def test_k8s_deployments_run_the_cli_with_the_secret_and_shared_state(
    k8s: dict[tuple[str, str], dict[str, Any]], prod: HourglassConfig, name: str, verb: str
) -> None:
    pod = k8s[("Deployment", name)]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["args"] == [verb, "--config", CONFIG_IN_CONTAINER]
    assert container["envFrom"][0] == {"secretRef": {"name": "hourglass-secrets"}}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert Path(CONFIG_IN_CONTAINER).parent.as_posix() in mounts
    state = mounts[prod.state_dir]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "hourglass-config"
    if verb == "service":
        assert volumes[state["name"]]["persistentVolumeClaim"]["claimName"] == "hourglass-state"
        assert not state.get("readOnly", False)
    else:  # the gateway shares no disk: its state dir is the API keys Secret, read-only
        assert volumes[state["name"]]["secret"]["secretName"] == "hourglass-gateway-keys"
        assert state["readOnly"] is True
        assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]


def test_k8s_service_is_a_single_gpu_pod_with_a_long_grace_period(
    k8s: dict[tuple[str, str], dict[str, Any]], prod: HourglassConfig
) -> None:
    deployment = k8s[("Deployment", "hourglass-service")]["spec"]
    assert deployment["replicas"] == 1 and deployment["strategy"]["type"] == "Recreate"
    pod = deployment["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 120
    [container] = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["ports"] == [{"name": "ops-api", "containerPort": prod.api.port}]
    ops = k8s[("Service", "hourglass-ops")]["spec"]
    assert ops["type"] == "ClusterIP" and ops["ports"][0]["port"] == prod.api.port
    gateway = k8s[("Service", "hourglass-gateway")]["spec"]
    assert gateway["ports"][0]["port"] == prod.api.gateway_port


# --- scale-out on kubernetes: vLLM fleet, gateways on the routes topic, the Ray cluster ----------


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@pytest.fixture(scope="module")
def raycluster() -> dict[str, Any]:
    [doc] = list(yaml.safe_load_all((DEPLOY / "k8s" / "raycluster.yaml").read_text()))
    return doc


def test_k8s_service_env_overrides_make_a_valid_scaled_out_config(
    k8s: dict[tuple[str, str], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.config import RLConfig

    [container] = k8s[("Deployment", "hourglass-service")]["spec"]["template"]["spec"]["containers"]
    for key, value in {**REAL_SECRETS, **_env(container)}.items():
        if (
            key.startswith("HOURGLASS_RL__")
            and key.removeprefix("HOURGLASS_RL__").split("__")[0].lower() not in RLConfig.model_fields
        ):
            continue  # the Ray executor's fields come with the Ray executor itself
        monkeypatch.setenv(key, value)
    cfg = load_config(DEPLOY / "production.toml")
    [vllm] = [k8s[("StatefulSet", "vllm")]]
    n = vllm["spec"]["replicas"]
    assert n >= 2 and cfg.serving.replicas == [f"http://vllm-{i}.vllm:8000" for i in range(n)]
    assert cfg.serving.adapter_share_uri is not None and "://" in cfg.serving.adapter_share_uri
    assert cfg.serving.routes_source == "kafka" and cfg.kafka.routes_topic == "hourglass.routes"
    if "executor" in RLConfig.model_fields:
        # the rounds train on the RayCluster, the reward-model candidate too; the exchange is the object store
        assert cfg.rl.executor == "ray" and cfg.rl.ray.address.startswith("ray://")
        assert any(c.reward and c.reward[0].fn == "reward_model" for c in cfg.candidates)
        assert (cfg.rl.ray.storage_uri or "").startswith("s3://")


def test_k8s_vllm_fleet_is_addressable_per_pod_and_fetches_adapters_from_the_share(
    k8s: dict[tuple[str, str], dict[str, Any]], prod: HourglassConfig
) -> None:
    vllm = k8s[("StatefulSet", "vllm")]["spec"]
    headless = k8s[("Service", vllm["serviceName"])]["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"] == vllm["selector"]["matchLabels"]
    pod = vllm["template"]["spec"]
    [container] = pod["containers"]
    argv = [str(a) for a in container["args"]]
    assert _flag(argv, "--served-model-name") == prod.serving.base_served_name
    assert int(_flag(argv, "--max-lora-rank")) == prod.serving.max_lora_rank
    assert int(_flag(argv, "--max-loras")) == prod.serving.max_loras
    assert int(_flag(argv, "--max-model-len")) == prod.serving.max_model_len
    assert "--enable-lora" in argv
    env = _env(container)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"  # resolver plugins run only with runtime updating on
    [service] = k8s[("Deployment", "hourglass-service")]["spec"]["template"]["spec"]["containers"]
    assert env["HOURGLASS_ADAPTER_SHARE"] == _env(service)["HOURGLASS_SERVING__ADAPTER_SHARE_URI"]
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]  # no disk shared with the service
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_k8s_gateways_follow_the_routes_topic_and_reach_every_replica(
    k8s: dict[tuple[str, str], dict[str, Any]], prod: HourglassConfig
) -> None:
    assert prod.serving.routes_source == "kafka"
    gateway = k8s[("Deployment", "hourglass-gateway")]["spec"]
    assert gateway["replicas"] >= 2
    [container] = gateway["template"]["spec"]["containers"]
    upstream = _env(container)["HOURGLASS_GATEWAY__UPSTREAM_URL"]
    host, port = upstream.removeprefix("http://").split(":")
    lb = k8s[("Service", host)]["spec"]
    assert lb["selector"] == k8s[("StatefulSet", "vllm")]["spec"]["selector"]["matchLabels"]
    assert lb.get("clusterIP") != "None" and lb["ports"][0]["port"] == int(port)


def test_k8s_raycluster_has_a_head_and_a_gpu_worker_group_the_service_connects_to(
    raycluster: dict[str, Any], k8s: dict[tuple[str, str], dict[str, Any]]
) -> None:
    assert raycluster["apiVersion"] == "ray.io/v1" and raycluster["kind"] == "RayCluster"
    head = raycluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    [head_container] = head["template"]["spec"]["containers"]
    assert {"containerPort": 10001, "name": "client"} in head_container["ports"]
    [workers] = raycluster["spec"]["workerGroupSpecs"]
    assert workers["rayStartParams"]["num-gpus"] == "1" and workers["replicas"] >= 1
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    [worker] = workers["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    [service] = k8s[("Deployment", "hourglass-service")]["spec"]["template"]["spec"]["containers"]
    address = f"ray://{raycluster['metadata']['name']}-head-svc:10001"  # KubeRay's head Service name
    env = _env(service)
    assert env["HOURGLASS_RL__RAY__ADDRESS"] == env["RAY_ADDRESS"] == address
    # the driver and the cluster run one image (Ray client needs matching Ray and Python versions)
    assert head_container["image"] == worker["image"] == service["image"]
