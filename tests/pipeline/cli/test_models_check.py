"""``hourglass models check FOLDER``: any local Hugging Face folder, refused with a reason for what Hourglass cannot
serve or train (no safetensors weights, an architecture vLLM's build here lacks or cannot load LoRA into, no chat
template), and ``hourglass up`` refusing such a folder as ``model.name`` before it starts vLLM.

The folders are written by the tests (a config, a one-tensor safetensors file, a tokenizer config): the check reads
JSON and file names, never weights, so no model runs here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from pipeline.cli.main import app, base_model_dir
from pipeline.config import HourglassConfig
from trainer.errors import ModelStoreError

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if tools %}{{ tools }}{% endif %}"
)


def _folder(root: Path, architecture: str = "Qwen2ForCausalLM", model_type: str = "qwen2") -> Path:
    """A folder that passes: a Qwen2 config with tied embeddings, safetensors weights, a tools chat template."""
    folder = root / "model"
    folder.mkdir()
    config = {"architectures": [architecture], "model_type": model_type, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(folder / "model.safetensors"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return folder


def _check(folder: Path) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["models", "check", str(folder), "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_a_servable_folder_passes_with_what_was_found(tmp_path: Path) -> None:
    code, out = _check(_folder(tmp_path))
    assert code == 0 and out["ok"] and out["problems"] == [] and out["warnings"] == []
    assert (out["architecture"], out["tied_embeddings"], out["weight_files"]) == (
        "Qwen2ForCausalLM",
        True,
        ["model.safetensors"],
    )
    assert out["chat_template"] and out["template_offers_tools"]


def test_a_folder_without_safetensors_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    code, out = _check(folder)
    assert code == 2 and not out["ok"]
    (problem,) = out["problems"]
    assert "no *.safetensors" in problem and "pytorch_model.bin" in problem and "safe_serialization" in problem


@pytest.mark.parametrize(
    ("architecture", "model_type", "reason"),
    [
        ("CTRLLMHeadModel", "ctrl", "not in the model registry of vLLM"),  # transformers trains it; vLLM has none
        ("MambaForCausalLM", "mamba", "cannot load LoRA adapters"),  # vLLM serves it, without LoRA
    ],
)
def test_an_architecture_vllm_cannot_serve_with_lora_is_refused(
    tmp_path: Path, architecture: str, model_type: str, reason: str
) -> None:
    code, out = _check(_folder(tmp_path, architecture, model_type))
    assert code == 2 and out["architecture"] == architecture
    (problem,) = out["problems"]
    assert architecture in problem and reason in problem


def test_a_folder_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    code, out = _check(folder)
    assert code == 2 and not out["chat_template"]
    (problem,) = out["problems"]
    assert "no chat template" in problem


def test_every_problem_is_reported_at_once_and_the_human_form_names_them(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "CTRLLMHeadModel", "ctrl")
    (folder / "model.safetensors").unlink()
    (folder / "tokenizer_config.json").unlink()
    code, out = _check(folder)
    assert code == 2 and len(out["problems"]) == 3
    human = CliRunner().invoke(app, ["models", "check", str(folder)])
    assert human.exit_code == 2 and "3 problem(s)" in human.output and "no chat template" in human.output
    code, out = _check(tmp_path / "missing")
    assert code == 2 and out["problems"] == [f"{tmp_path / 'missing'} is not a folder"]


def test_up_refuses_a_brought_folder_before_starting_vllm(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    cfg = HourglassConfig(model={"name": str(folder)})
    assert base_model_dir(cfg) == folder  # the good folder is used as it is
    (folder / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelStoreError, match="cannot be used: the tokenizer has no chat template"):
        base_model_dir(cfg)


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("config.json", "[" * 100_000, "config.json"),  # nests past the JSON parser's recursion limit
        ("tokenizer_config.json", "[" * 100_000, "chat template"),
        ("tokenizer_config.json", json.dumps({"chat_template": [{"name": ["x"], "template": "t"}]}), "chat template"),
        ("config.json", json.dumps({"architectures": ["Qwen2ForCausalLM"], "pad": "x" * (65 << 20)}), "MiB"),
    ],
)
def test_a_hostile_json_file_is_a_problem_not_a_traceback(tmp_path: Path, name: str, text: str, needle: str) -> None:
    """Found by a red-team pass: a deeply nested config.json / tokenizer_config.json (RecursionError) or a named
    chat template list whose name is a list (TypeError) crashed the check with a traceback; a huge config.json (or
    one linked to /dev/zero) was read whole."""
    folder = _folder(tmp_path)
    (folder / name).write_text(text)
    code, out = _check(folder)
    assert code == 2 and not out["ok"]
    assert any(needle in problem for problem in out["problems"]), out["problems"]


def test_a_config_linked_to_an_endless_file_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("/dev/zero")
    code, out = _check(folder)
    assert code == 2 and any("config.json" in p for p in out["problems"]), out["problems"]


def test_a_host_without_transformers_is_told_which_extra_checks_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a red-team pass: on a light role's host (no transformers) the check was a ModuleNotFoundError
    traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "transformers.models.auto.modeling_auto", None)
    result = CliRunner().invoke(app, ["models", "check", str(_folder(tmp_path))])
    assert result.exit_code == 1 and not isinstance(result.exception, ImportError)
    assert "hourglass[trainer]" in result.output


def test_safetensors_under_a_name_transformers_does_not_load_are_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "model.safetensors").rename(folder / "adapter_model.safetensors")  # a LoRA adapter, not a base
    code, out = _check(folder)
    assert code == 2 and not out["ok"]
    (problem,) = out["problems"]
    assert "no model.safetensors" in problem and "adapter_model.safetensors" in problem


def test_sharded_safetensors_with_their_index_pass(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    code, out = _check(folder)
    assert code == 0 and out["ok"], out["problems"]


@pytest.mark.parametrize("value", ["false", 0, None])
def test_a_tie_word_embeddings_that_is_not_a_bool_is_refused(tmp_path: Path, value: object) -> None:
    folder = _folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": value}))
    code, out = _check(folder)
    assert code == 2 and not out["ok"] and out["tied_embeddings"] is False
    (problem,) = out["problems"]
    assert f"tie_word_embeddings is {value!r}" in problem


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_a_named_pipe_in_place_of_a_json_file_is_refused_not_waited_on(tmp_path: Path, name: str) -> None:
    """Found by a red-team pass: a named pipe under config.json / tokenizer_config.json blocked open() until a
    writer came: the check hung."""
    import os

    folder = _folder(tmp_path)
    (folder / name).unlink()
    os.mkfifo(folder / name)
    code, out = _check(folder)
    assert code == 2 and not out["ok"], out


def test_a_blank_chat_template_file_is_no_chat_template(tmp_path: Path) -> None:
    """Found by a red-team pass: a whitespace-only chat_template.jinja (which the tokenizer loads over the one in
    tokenizer_config.json) passed as a chat template; every prompt renders as nothing."""
    folder = _folder(tmp_path)
    (folder / "chat_template.jinja").write_text("  \n")
    code, out = _check(folder)
    assert code == 2 and not out["chat_template"]
    (problem,) = out["problems"]
    assert "no chat template" in problem


def test_a_model_type_that_looks_like_markup_is_printed_as_text(tmp_path: Path) -> None:
    """Found by a red-team pass: config.json's model_type went unescaped into the human OK line; ``[/]`` made Rich
    raise MarkupError (a traceback, exit 1) for a folder that passes."""
    folder = _folder(tmp_path, model_type="[/] [bold]x")
    result = CliRunner().invoke(app, ["models", "check", str(folder)])
    assert result.exit_code == 0, result.output
    assert "[/] [bold]x" in result.output


@pytest.mark.parametrize(
    ("index", "needle"),
    [
        ({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}, "not files of the folder"),
        ({"weight_map": {"model.embed_tokens.weight": "../other/model.safetensors"}}, "not files of the folder"),
        ({"metadata": {}}, "no weight_map"),
        ("[", "cannot be read"),
    ],
)
def test_a_shard_index_naming_shards_the_folder_lacks_is_refused(tmp_path: Path, index: object, needle: str) -> None:
    """Found by a red-team pass: any model.safetensors.index.json passed the check next to any *.safetensors (an
    adapter_model.safetensors, a missing shard, a shard outside the folder); transformers failed only at load."""
    folder = _folder(tmp_path)
    (folder / "model.safetensors").rename(folder / "adapter_model.safetensors")
    (folder / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    code, out = _check(folder)
    assert code == 2 and not out["ok"]
    (problem,) = out["problems"]
    assert "model.safetensors.index.json" in problem and needle in problem
