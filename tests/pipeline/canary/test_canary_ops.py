"""What a round does with its winner when the canary is on, and the operator's canary commands
(CLI and ops API; real MLflow, no vLLM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from fastapi.testclient import TestClient
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from pipeline.registry import aliases
from pipeline.cli import canary as cli_canary
from pipeline.api import create_api
from pipeline.canary import state
from pipeline.canary.ops import canary_status
from pipeline.registry.client import RegistryError
from pipeline.config import load_config
from pipeline.registry.models import register_round
from pipeline.service import HourglassService
from tests.pipeline.round_fakes import FixedSnapshot
from tests.pipeline.serving_helpers import make_adapter, make_round
from trainer.model.store import fingerprint_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def versions(
    tiny_model: Path, mlflow_uri: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[str], str]:
    """A config file and four registered versions of model ``can-ops`` (nothing promoted)."""
    tmp = tmp_path_factory.mktemp("canary-ops")
    config = tmp / "hourglass.toml"
    config.write_text(
        f'state_dir = "{tmp / "state"}"\n'
        f'[registry]\ntracking_uri = "{mlflow_uri}"\nexperiment = "canary-ops"\nembedded = false\n'
        f'[buffer]\nroot = "{tmp / "buffer"}"\ndead_letter_root = "{tmp / "dlq"}"\n'
        f'[serving]\nmodel_name = "can-ops"\nembedded = false\n'
    )
    cfg = load_config(config)
    adapter = make_adapter(tiny_model, tmp / "a", seed=21)
    fp = fingerprint_of(tiny_model)
    made = [
        register_round(cfg, make_round(adapter, fp, round_id=f"can-ops-{i}", model="can-ops"))[0].version
        for i in range(4)
    ]
    return config, made, mlflow_uri


def test_round_winner_goes_to_challenger_and_never_replaces_a_running_canary(versions) -> None:
    config, (v1, v2, v3, _), mlflow_uri = versions
    cfg = load_config(config)
    client = MlflowClient(mlflow_uri)
    first = state.promote_or_challenge(cfg, "can-ops", v1)  # no champion yet: a canary against the base
    assert (first["action"], first["control"]) == ("challenger", "base")
    assert aliases.champion_version(client, "can-ops", "champion") is None
    view = canary_status(cfg, ["can-ops"])["can-ops"]["canary"]
    assert (view["version"], view["control"], view["champion_version"]) == (v1, "base", None), view
    with pytest.raises(RegistryError, match="no champion: the base model serves it"):
        aliases.rollback(cfg, "can-ops")
    assert state.promote_challenger(cfg, "can-ops", client=client, reason="test")["previous"] is None
    assert aliases.champion_version(client, "can-ops", "champion") == v1
    assert state.promote_or_challenge(cfg, "can-ops", v2)["action"] == "challenger"
    client.set_model_version_tag("can-ops", v2, state.TAG_STARTED, "2026-01-01T00:00:00.000+00:00")
    again = state.promote_or_challenge(cfg, "can-ops", v2)  # a resumed round: the canary keeps its start
    assert again["action"] == "challenger" and client.get_model_version("can-ops", v2).tags[
        state.TAG_STARTED
    ].startswith("2026-01-01")
    waiting = state.promote_or_challenge(cfg, "can-ops", v3)
    assert waiting["action"] == "not_started" and f"v{v2} is on canary" in waiting["reason"]
    assert (
        state.challenger_version(client, cfg, "can-ops") == v2
        and aliases.champion_version(client, "can-ops", "champion") == v1
    )
    assert "can-ops v3 registered, no canary" in state.describe([waiting])

    canary_off = cfg.serving.canary.model_copy(update={"enabled": False})
    off = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"canary": canary_off})})
    assert state.promote_or_challenge(off, "can-ops", v3)["action"] == "promoted"
    assert aliases.champion_version(client, "can-ops", "champion") == v3
    aliases.rollback(cfg, "can-ops", v1)


def test_cli_status_and_abort_then_api_needs_a_token_to_promote(versions, tmp_path: Path) -> None:
    config, (v1, v2, _, v4), mlflow_uri = versions
    cfg = load_config(config)
    client = MlflowClient(mlflow_uri)
    if aliases.champion_version(client, "can-ops", "champion") is None:
        aliases.promote(cfg, "can-ops", v1)
    state.start_challenger(cfg, "can-ops", v2)
    app = typer.Typer()
    app.callback()(lambda: None)
    cli_canary.register(app)
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> dict | str:
        result = runner.invoke(app, ["canary", *args, "--config", str(config), "--json"])
        assert result.exit_code == code, result.output
        return json.loads(result.stdout) if code == 0 else result.output

    status = run("status", "--model", "can-ops")["can-ops"]["canary"]
    assert (
        status["version"] == v2
        and status["decision"] == "continue"
        and status["fraction"] == cfg.serving.canary.fraction
    )
    out = run("abort", "--model", "can-ops")
    assert out == {"model": "can-ops", "version": v2, "decision": "abort"}
    assert json.loads(client.get_model_version("can-ops", v2).tags[state.TAG_RESULT])["reason"] == "abort by cli"
    assert run("status", "--model", "can-ops")["can-ops"]["canary"] is None
    assert "no version on canary" in run("promote", "--model", "can-ops", code=1)

    state.start_challenger(cfg, "can-ops", v4)
    service = HourglassService(cfg, base_fingerprint="f" * 64, ingest=False, reconcile=False)
    with TestClient(create_api(service), base_url="http://127.0.0.1") as api:
        assert api.post("/canary/can-ops/promote").status_code == 401
        assert api.post("/canary/can-ops/promote", headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert api.get("/canary").json()["can-ops"]["canary"]["version"] == v4
        auth = {"Authorization": f"Bearer {service.api_token}"}
        assert api.post("/canary/nope/abort", headers=auth).status_code == 404
        promoted = api.post("/canary/can-ops/promote", params={"reason": "looked fine"}, headers=auth)
        assert promoted.status_code == 200 and promoted.json()["version"] == v4, promoted.text
        result = json.loads(client.get_model_version("can-ops", v4).tags[state.TAG_RESULT])
        assert result["reason"] == "promote by ops api: looked fine"
        assert api.post("/canary/can-ops/abort", headers=auth).status_code == 404  # nothing on canary any more
        assert "hourglass_canary_outcomes_total" in api.get("/metrics").text
    assert aliases.champion_version(client, "can-ops", "champion") == v4
    assert state.challenger_version(client, cfg, "can-ops") is None


def test_a_round_puts_its_winner_on_canary_and_says_so(
    versions, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa

    from pipeline.rounds import job as round_job

    config, _, mlflow_uri = versions
    cfg = load_config(config).model_copy(update={"state_dir": str(tmp_path / "state")})
    fp = fingerprint_of(tiny_model)
    adapter = make_adapter(tiny_model, tmp_path / "w", seed=31)
    results = iter([make_round(adapter, fp, round_id=f"rr-{tmp_path.name}-{i}", model="can-rr") for i in range(2)])

    class Rounds(FixedSnapshot):  # the registry and the canary for real; the trainer's results made by hand
        def train_and_evaluate(self, record, table, on_phase):
            return next(results)

    runner = round_job.RoundRunner(cfg, fp, steps=Rounds(cfg, fp, pa.table({"x": [1, 2]})))
    first = runner.run("test")
    v1 = first.versions["can-rr"]
    assert first.state == "done" and first.reason == f"can-rr v{v1} on canary against the base", first.reason
    client = MlflowClient(mlflow_uri)
    assert aliases.champion_version(client, "can-rr", "champion") is None  # no champion yet: the base serves
    state.promote_challenger(cfg, "can-rr", client=client, reason="users liked it")
    second = runner.run("test")
    version = second.versions["can-rr"]
    assert second.state == "done" and second.reason == f"can-rr v{version} on canary", second.reason
    assert state.challenger_version(client, cfg, "can-rr") == version
    assert aliases.champion_version(client, "can-rr", "champion") == v1
