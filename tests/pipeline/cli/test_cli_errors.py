"""What an operator sees when the input is wrong or nothing is running: a one-line
``error:`` with the reason, exit code 1, no traceback, no credentials echoed.

Runs the installed console script (``hourglass``) so the top-level handler in
``pipeline.cli.main.main`` is exercised too. Nothing listens on the ports used here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.stack import free_port

HOURGLASS = Path(sys.executable).with_name("hourglass")


def _run(*args: str, env: dict[str, str] | None = None, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HOURGLASS), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**os.environ, "HOURGLASS_STATE_DIR": str(cwd / "state"), **(env or {})},
    )


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["produce", "missing.jsonl"], {}, "missing.jsonl: no such file"),
        (["produce", "."], {}, ": not a regular file"),
        (["replay", "--sharegpt", "-3"], {}, "--sharegpt must be at least 1"),
        (["buffer", "stats", "--no-lag"], {"HOURGLASS_BUFFER__ROOT": "not-a-dir.txt"}, "NotADirectoryError"),
        (["retrain"], {"HOURGLASS_STATE_DIR": "not-a-dir.txt"}, "FileExistsError"),
        (["retrain", "--candidates", ""], {}, "names no candidate"),  # was a round of every candidate
        (["retrain", "--candidates", " , "], {}, "names no candidate"),
        (["retrain", "--until", "2026-12-06T14:00:00"], {}, "with a time zone"),
        (["retrain", "--until", "yesterday"], {}, "not an ISO 8601 time"),
        (["retrain", "--until", "2026"], {}, "not an ISO 8601 time"),
    ],
    ids=[
        "produce-missing",
        "produce-dir",
        "replay-negative",
        "buffer-root-file",
        "state-dir-file",
        "retrain-empty",
        "retrain-commas",
        "retrain-until-naive",
        "retrain-until-garbage",
        "retrain-until-digits",
    ],
)
def test_bad_paths_and_values_get_one_clear_line(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    (tmp_path / "not-a-dir.txt").write_text("x")
    # produce and replay must refuse before talking to a broker: none listens on this port
    env = {
        "HOURGLASS_KAFKA__BOOTSTRAP_SERVERS": f'["127.0.0.1:{free_port()}"]',
        "HOURGLASS_API__PORT": str(free_port()),  # no ops API listens there either
        **env,
    }
    result = _run(*args, env=env, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "error:" in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr


def test_promote_without_mlflow_says_so_quickly_and_hides_the_password(tmp_path: Path) -> None:
    uri = f"http://alice:S3cretPW@127.0.0.1:{free_port()}"
    result = _run("promote", "3", env={"HOURGLASS_REGISTRY__TRACKING_URI": uri}, cwd=tmp_path)
    assert result.returncode == 1
    assert "no MLflow tracking server answers at http://***@127.0.0.1" in result.stderr
    assert "S3cretPW" not in result.stderr + result.stdout
    shown = _run("config", "show", env={"HOURGLASS_REGISTRY__TRACKING_URI": uri}, cwd=tmp_path)
    assert shown.returncode == 0 and "S3cretPW" not in shown.stdout and "http://***@127.0.0.1" in shown.stdout


@pytest.mark.parametrize(
    ("name", "says"), [("", "at least 1 character"), ("x" * 200, "at most 128 characters")], ids=["empty", "long"]
)
def test_keys_create_with_a_bad_name_says_why_without_a_traceback(tmp_path: Path, name: str, says: str) -> None:
    result = _run("keys", "create", name, cwd=tmp_path)  # was a pydantic ValidationError traceback, exit 1
    assert result.returncode == 1 and "error:" in result.stderr and "name" in result.stderr
    assert says in result.stderr.replace("\n", " ") and "Traceback" not in result.stderr
    assert not (tmp_path / "state" / "gateway-keys.json").exists()


def test_kafka_client_chatter_stays_out_of_the_commands_output(tmp_path: Path) -> None:
    """`hourglass up` printed 57 kafka-python INFO lines (connections, bootstraps) before its table."""
    import logging

    from typer.testing import CliRunner

    from pipeline.cli.main import app

    logging.getLogger("kafka").setLevel(logging.NOTSET)
    CliRunner().invoke(app, ["config", "check", str(tmp_path / "missing.toml")])
    assert logging.getLogger("kafka").level == logging.WARNING
    CliRunner().invoke(app, ["--verbose", "config", "check", str(tmp_path / "missing.toml")])
    assert logging.getLogger("kafka").level == logging.NOTSET  # --verbose: the root level decides again
