"""The registry CLI (`promote`, `rollback`, `models list --json`) against a real MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from pipeline.cli import registry as cli_registry
from pipeline.registry.models import register_round
from tests.pipeline.serving_helpers import make_adapter, make_config, make_round
from trainer.model.store import fingerprint_of

pytestmark = pytest.mark.integration


@pytest.fixture
def cli() -> typer.Typer:
    app, models_app = typer.Typer(), typer.Typer()
    app.add_typer(models_app, name="models")
    cli_registry.register(app, models_app)
    return app


def test_promote_rollback_and_list(cli, tmp_path: Path, mlflow_uri, vllm_tiny, tiny_model):
    model = "cli-model"
    config = tmp_path / "hourglass.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[registry]\ntracking_uri = "{mlflow_uri}"\nexperiment = "cli"\n'
        f'[serving]\nmodel_name = "{model}"\nreplicas = ["{vllm_tiny}"]\n'
    )
    cfg = make_config(tmp_path, mlflow_uri, [vllm_tiny], experiment="cli")
    adapter = make_adapter(tiny_model, tmp_path / "a", seed=7)
    fp = fingerprint_of(tiny_model)
    v1, v2 = (register_round(cfg, make_round(adapter, fp, round_id=f"cli-{i}", model=model))[0].version for i in (1, 2))
    runner = CliRunner()

    def run(*args: str) -> dict:
        result = runner.invoke(cli, [*args, "--config", str(config), "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    assert run("promote", v1) == {"model": model, "version": v1, "previous": None}
    assert run("promote", v2, "--model", model) == {"model": model, "version": v2, "previous": v1}
    assert run("rollback")["version"] == v1
    assert run("rollback", "--to", v2)["version"] == v2

    listing = run("models", "list")
    [entry] = [m for m in listing["models"] if m["model"] == model]
    assert entry["aliases"] == {"champion": v2, "previous-champion": v1}
    assert [v["version"] for v in entry["versions"]] == [v1, v2]
    assert entry["versions"][1]["tags"]["hourglass.round_id"] == "cli-2"
    assert "base" in listing["replicas"][vllm_tiny]

    bad = runner.invoke(cli, ["promote", "99", "--config", str(config), "--json"])
    assert bad.exit_code == 1 and "no version '99'" in bad.output
