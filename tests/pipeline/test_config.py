"""Typed configuration: every mistake reported at once, env overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli.main import app
from pipeline.config import load_config
from pipeline.errors import ConfigError
from tests import REPO


THREE_MISTAKES = """
[kafka]
bootstrap_servers = ["localhost"]          # no port
[rl.rollout]
group_size = 0                              # must be >= 1
[api]
prot = 18080                                # typo of `port`
"""


def test_example_config_is_valid_and_is_the_embedded_default() -> None:
    cfg = load_config(REPO / "deploy" / "hourglass.toml")
    assert cfg.kafka.embedded and cfg.registry.embedded and cfg.serving.embedded
    assert cfg.registry.tracking_uri.startswith("http://127.0.0.1")
    assert cfg.api.host == "127.0.0.1"
    assert [c.name for c in cfg.candidates] == ["grpo-rm", "kto"]
    assert cfg.rl.gate.metric == "feedback"  # learns from and is gated by user feedback by default


def test_three_mistakes_are_all_reported_with_path_and_value(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(THREE_MISTAKES)
    with pytest.raises(ConfigError) as caught:
        load_config(bad)
    problems = caught.value.problems
    assert len(problems) == 3
    assert any(p.startswith("kafka.bootstrap_servers:") and "'localhost'" in p for p in problems)
    assert any(p.startswith("rl.rollout.group_size:") and "got 0" in p for p in problems)
    assert any(p.startswith("api.prot:") and "unknown field" in p for p in problems)


def test_cli_config_check_prints_all_three_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(THREE_MISTAKES)
    result = CliRunner().invoke(app, ["config", "check", str(bad)])
    assert result.exit_code == 2
    out = result.output
    for path in ("kafka.bootstrap_servers", "rl.rollout.group_size", "api.prot"):
        assert path in out
    assert "3 problem(s)" in out


def test_cli_config_check_json(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(THREE_MISTAKES)
    result = CliRunner().invoke(app, ["config", "check", "--json", str(bad)])
    assert result.exit_code == 2
    assert '"ok": false' in result.stdout


def test_environment_overrides_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOURGLASS_API__PORT", "19999")
    monkeypatch.setenv("HOURGLASS_KAFKA__BOOTSTRAP_SERVERS", '["broker-a:9092", "broker-b:9092"]')
    cfg = load_config(REPO / "deploy" / "hourglass.toml")
    assert cfg.api.port == 19999
    assert cfg.kafka.bootstrap_servers == ["broker-a:9092", "broker-b:9092"]


def test_bad_environment_value_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOURGLASS_API__PORT", "99999")
    with pytest.raises(ConfigError) as caught:
        load_config(None)
    # the problem names the variable, not the file, as where the value came from
    assert any(
        p.startswith("api.port:") and p.endswith("(got '99999' from HOURGLASS_API__PORT)")
        for p in caught.value.problems
    )
    monkeypatch.setenv("HOURGLASS_SERVING", '{"max_num_seqs": 0}')  # inside a section's JSON
    with pytest.raises(ConfigError) as caught:
        load_config(REPO / "deploy" / "hourglass.toml")
    assert any(
        p.startswith("serving.max_num_seqs:") and p.endswith("(got 0 from HOURGLASS_SERVING)")
        for p in caught.value.problems
    )


def test_environment_value_that_is_not_json_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOURGLASS_KAFKA__BOOTSTRAP_SERVERS", "broker:9092")  # a list field needs JSON
    with pytest.raises(ConfigError, match=r"kafka.*JSON"):
        load_config(None)


def test_cross_section_rules(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(
        '[[candidates]]\nname = "a"\nlora_rank = 64\n[[candidates]]\nname = "a"\n[serving]\nmax_lora_rank = 16\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_config(conf)
    text = " ".join(caught.value.problems)
    assert "unique" in text and "'a'" in text


@pytest.mark.parametrize("name", ["reward-model", "reward-model-champion", "judge", "judge-champion"])
def test_a_candidate_cannot_take_the_reward_model_s_adapter_names(tmp_path: Path, name: str) -> None:
    # the round would fail late ("already exists in the store") and both would share last/<name>
    conf = tmp_path / "c.toml"
    rm = '[rl.reward_model]\nname = "judge"\n' if name.startswith("judge") else ""
    conf.write_text(f'[[candidates]]\nname = "{name}"\n[[candidates]]\nname = "ok"\n{rm}')
    with pytest.raises(ConfigError) as caught:
        load_config(conf)
    assert f"candidate names ['{name}'] are taken by the reward model's adapters" in " ".join(caught.value.problems)
    conf.write_text(f'[[candidates]]\nname = "{name}x"\n{rm}')
    assert load_config(conf).candidates[0].name == f"{name}x"


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[kafka\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)
    # an integer past Python's 4,300-digit conversion limit, and arrays nested past the parser's recursion
    broken.write_text(f"[serving]\nmax_num_seqs = {'9' * 5000}\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)
    broken.write_text(f"[serving]\nmax_num_seqs = {'[' * 5000}{']' * 5000}\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(broken)


def test_true_or_false_in_a_number_field_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # pydantic's lax mode reads a TOML `true` in an int field as 1 and in a float field as 1.0
    conf = tmp_path / "c.toml"
    conf.write_text("[serving]\nmax_num_seqs = true\n[rl.gate]\nmargin = false\n[rl.split]\nheldout_fraction = true\n")
    with pytest.raises(ConfigError) as caught:
        load_config(conf)
    problems = " ".join(caught.value.problems)
    for field in ("serving.max_num_seqs", "rl.gate.margin", "rl.split.heldout_fraction"):
        assert f"{field}: " in problems and "expected a number" in problems, (field, problems)
    conf.write_text("[serving]\nmax_num_seqs = 8\nembedded = false\n")  # booleans stay booleans
    monkeypatch.setenv("HOURGLASS_RL__GATE__EVAL_PROMPTS", "12")  # an environment string still reads as a number
    cfg = load_config(conf)
    assert (cfg.serving.max_num_seqs, cfg.rl.gate.eval_prompts) == (8, 12)


def test_an_environment_variable_nested_too_deeply_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOURGLASS_SERVING", '{"max_num_seqs": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(None)


def test_candidates_compete_for_the_public_model_name_by_default(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(
        '[serving]\nmodel_name = "support-bot"\n[[candidates]]\nname = "a"\n[[candidates]]\nname = "b"\nserved_model = "other"\n'
    )
    cfg = load_config(conf)
    assert [c.served_model for c in cfg.candidates] == ["support-bot", "other"]


@pytest.mark.parametrize(
    "env,problem",
    [
        ({"HOURGLASS_SCHEDULE__CRON": "61 * * * *"}, "schedule.cron: cron '61 * * * *'"),
        ({"HOURGLASS_RL__WINDOW": "99999999999d"}, "rl.window: window '99999999999d' must be between"),
        ({"HOURGLASS_RL__WINDOW": "0s"}, "rl.window: window '0s' must be between"),
        ({"HOURGLASS_API__TOKEN": "short"}, "api.token: Value error, the API token must be at least 16"),
        (
            {"HOURGLASS_API__PORT": "18500", "HOURGLASS_API__GATEWAY_PORT": "18500"},
            "api: Value error, api.port and api.gateway_port must differ",
        ),
        (
            {"HOURGLASS_KAFKA__TRACES_TOPIC": "hourglass.feedback"},
            "kafka: Value error, traces_topic and feedback_topic are both",
        ),
        ({"HOURGLASS_RL__ROLLOUT__TEMPERATURE": "inf"}, "rl.rollout.temperature: Input should be a finite number"),
        (
            {"HOURGLASS_BUFFER__USER_HASH_KEY": "short"},
            "buffer.user_hash_key: Value error, user_hash_key must be at least 16",
        ),
        (
            {"HOURGLASS_CANDIDATES": '[{"name": "a", "reward": [{"fn": "nosuchfn"}]}]'},
            "candidates.0.reward.0.fn: Value error, unknown reward 'nosuchfn'",
        ),
        (
            {"HOURGLASS_CANDIDATES": '[{"name": "a", "served_model": "../evil"}]'},
            "candidates.0.served_model: String should match pattern",
        ),
    ],
    ids=[
        "cron-value",
        "window-huge",
        "window-zero",
        "token-short",
        "same-ports",
        "same-topics",
        "inf",
        "hash-key-short",
        "unknown-reward",
        "served-model-path",
    ],
)
def test_values_that_would_fail_at_run_time_are_caught_by_config_check(
    monkeypatch: pytest.MonkeyPatch, env: dict, problem: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as caught:
        load_config(None)
    assert any(p.startswith(problem.replace("Value error, ", "")) for p in caught.value.problems), caught.value.problems


def test_empty_token_means_unset_and_staging_follows_state_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOURGLASS_API__TOKEN", "")
    monkeypatch.setenv("HOURGLASS_STATE_DIR", str(tmp_path / "s"))
    cfg = load_config(None)
    assert cfg.api.token is None
    assert cfg.serving.staging_dir == str(tmp_path / "s" / "staging")


def test_config_check_warns_when_external_services_keep_the_public_hash_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default user_hash_key is in the source: with it, user-id hashes are reversible by hashing guesses.
    A config with external services passes (deployment left "embedded") but says so; the environment key
    silences it; with deployment = "production" (deploy/production.toml) it is refused outright."""
    import json as _json

    external = tmp_path / "external.toml"
    external.write_text('[kafka]\nembedded = false\nbootstrap_servers = ["kafka-0:9092"]\n')
    monkeypatch.delenv("HOURGLASS_BUFFER__USER_HASH_KEY", raising=False)
    result = CliRunner().invoke(app, ["config", "check", "--json", str(external)])
    assert result.exit_code == 0, result.output
    warnings = _json.loads(result.stdout)["warnings"]
    assert (
        len(warnings) == 1
        and "buffer.user_hash_key" in warnings[0]
        and "HOURGLASS_BUFFER__USER_HASH_KEY" in warnings[0]
    )
    result = CliRunner().invoke(app, ["config", "check", str(external)])
    assert result.exit_code == 0 and "warning" in result.output and "user_hash_key" in result.output
    monkeypatch.setenv("HOURGLASS_BUFFER__USER_HASH_KEY", "a-real-secret-of-32-characters!!")
    assert _json.loads(CliRunner().invoke(app, ["config", "check", "--json", str(external)]).stdout)["warnings"] == []
    monkeypatch.delenv("HOURGLASS_BUFFER__USER_HASH_KEY")
    refused = CliRunner().invoke(app, ["config", "check", "--json", str(REPO / "deploy" / "production.toml")])
    assert refused.exit_code == 2 and "buffer.user_hash_key" in refused.stdout
    local = _json.loads(
        CliRunner().invoke(app, ["config", "check", "--json", str(REPO / "deploy" / "hourglass.toml")]).stdout
    )
    assert local["warnings"] == []  # the embedded dev stack: nothing leaves the machine


def test_ray_executor_accepts_reward_model_candidates_and_keeps_actors_only_when_asked() -> None:
    from pipeline.config import HourglassConfig

    scored = {"name": "rm", "algorithm": "grpo", "reward": [{"fn": "reward_model", "weight": 1.0}]}
    cfg = HourglassConfig(candidates=[scored], rl={"executor": "ray"})
    assert cfg.rl.executor == "ray" and cfg.rl.ray.keep_actors is None  # None: the service keeps them, a CLI round not
    assert (
        HourglassConfig(candidates=[scored], rl={"executor": "ray", "ray": {"keep_actors": False}}).rl.ray.keep_actors
        is False
    )


def test_the_old_flat_rl_keys_and_reward_model_table_name_their_new_place(tmp_path: Path) -> None:
    """A config of the layout before [rl] had sections is refused with every moved key's new place, together
    with its other mistakes."""
    old = tmp_path / "old.toml"
    old.write_text(
        '[rl]\ngate_metric = "feedback"\nray_address = "auto"\nsteps_per_round = 0\n[reward_model]\nsteps = 4\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_config(old)
    problems = caught.value.problems
    assert "rl.gate_metric: moved: use [rl.gate] metric (see deploy/reference.toml)" in problems
    assert "rl.ray_address: moved: use [rl.ray] address (see deploy/reference.toml)" in problems
    assert any(p.startswith("reward_model: moved: [reward_model] is now [rl.reward_model]") for p in problems)
    assert any(p.startswith("rl.steps_per_round:") and "got 0" in p for p in problems)
    assert len(problems) == 4


def test_otel_section_is_off_by_default_and_on_from_the_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_config(REPO / "deploy" / "hourglass.toml").otel is None
    conf = tmp_path / "otel.toml"
    conf.write_text(
        '[otel]\ntopic = "genai-spans"\n[[otel.feedback]]\nattribute = "feedback.thumbs"\nsignal = "thumbs"\n'
    )
    cfg = load_config(conf)
    assert cfg.otel is not None and cfg.otel.topic == "genai-spans" and cfg.otel.encoding == "otlp_proto"
    assert [rule.signal for rule in cfg.otel.feedback] == ["thumbs"]
    monkeypatch.setenv("HOURGLASS_OTEL__ENCODING", "otlp_json")
    assert load_config(None).otel.encoding == "otlp_json"  # type: ignore[union-attr]
    conf.write_text('[otel]\ntopic = "bad topic!"\n')
    with pytest.raises(ConfigError) as err:
        load_config(conf)
    assert any("otel.topic" in problem for problem in err.value.problems), err.value.problems


def test_config_check_takes_the_file_as_an_argument_or_as_config(tmp_path: Path) -> None:
    conf = REPO / "deploy" / "hourglass.toml"
    for args in ([str(conf)], ["--config", str(conf)]):
        result = CliRunner().invoke(app, ["config", "check", *args, "--json"])
        assert result.exit_code == 0 and '"ok": true' in result.stdout, (args, result.output)
    for args in ([], [str(conf), "--config", str(conf)]):  # none, or two: say how to give it
        result = CliRunner().invoke(app, ["config", "check", *args])
        assert result.exit_code == 2 and "give the file once" in result.output, (args, result.output)


@pytest.mark.parametrize("size", [16, 48])
def test_a_kv_block_size_vllms_cpu_attention_cannot_run_is_refused(tmp_path: Path, size: int) -> None:
    """vLLM's CPU attention takes blocks of multiples of 32 (16 stops the server at start-up): refused in config."""
    conf = tmp_path / "c.toml"
    conf.write_text(f"[serving]\nblock_size = {size}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(conf)
    assert any(p.startswith("serving.block_size:") for p in caught.value.problems), caught.value.problems
    conf.write_text("[serving]\nblock_size = 64\n")
    assert load_config(conf).serving.block_size == 64


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("max_lora_rank = 4", "serving.max_lora_rank"),  # vLLM takes 1, 8, 16, 32, ...: 4 stopped it at start-up
        ("max_lora_rank = 1024", "serving.max_lora_rank"),
        ("max_loras = 1000000", "serving.max_loras"),
        ("max_model_len = 1e30", "serving.max_model_len"),
        ("max_model_len = 10000000000", "serving.max_model_len"),
        ("kv_cache_gib = 1000000000", "serving.kv_cache_gib"),
        ("block_size = 1048576", "serving.block_size"),
    ],
)
def test_serving_sizes_vllm_cannot_start_with_are_refused_naming_the_field(
    tmp_path: Path, line: str, field: str
) -> None:
    """Each loaded and only failed when vLLM started (a hostile pass's finding)."""
    conf = tmp_path / "c.toml"
    conf.write_text(f"[serving]\n{line}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(conf)
    assert any(p.startswith(f"{field}:") for p in caught.value.problems), caught.value.problems


def test_the_max_lora_rank_refusal_names_the_rank_that_fits(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text("[serving]\nmax_lora_rank = 20\n")
    with pytest.raises(ConfigError) as caught:
        load_config(conf)
    assert any("32 fits rank 20" in p for p in caught.value.problems), caught.value.problems
    conf.write_text("[serving]\nmax_lora_rank = 32\n")
    assert load_config(conf).serving.max_lora_rank == 32


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("HOURGLASS_SERVING__CANARY__FRACTION", "0.99995"),  # every routing key's bucket: no champion side left
        ("HOURGLASS_SERVING__CANARY__FRACTION", "0.00001"),  # below one bucket in 10000: no challenger side
        ("HOURGLASS_SERVING__CANARY__MIXTURE_SD", "1e-200"),  # its square underflows: every look would raise
        ("HOURGLASS_SERVING__CANARY__MIXTURE_SD", "1e200"),
    ],
)
def test_a_canary_that_could_never_decide_is_refused_at_load(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as caught:
        load_config(None)
    field = variable.removeprefix("HOURGLASS_").lower().replace("__", ".")
    assert any(p.startswith(f"{field}:") for p in caught.value.problems), caught.value.problems
