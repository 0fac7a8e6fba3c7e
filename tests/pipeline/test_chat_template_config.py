"""One chat template for the trainer and the served vLLM (``model.chat_template``), the tool parser the
embedded vLLM starts with (``serving.tool_call_parser``) and how many sequences it decodes together
(``serving.max_num_seqs``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline import stack
from pipeline.config import HourglassConfig
from trainer.config import ModelConfig
from trainer.templates import BUILTIN_TEMPLATES, CHATML_TOOLS


def _argv(cfg: HourglassConfig, tmp_path: Path) -> list[str]:
    (vllm,) = [s for s in stack.stack_services(cfg, tmp_path / "model") if s.name == "vllm"]
    return vllm.argv


def test_the_embedded_vllm_serves_with_the_trainers_template_and_the_configured_parser(tmp_path: Path) -> None:
    cfg = HourglassConfig.model_validate(
        {"model": {"chat_template": CHATML_TOOLS}, "serving": {"tool_call_parser": "hermes"}}
    )
    argv = _argv(cfg, tmp_path)
    assert argv[argv.index("--chat-template") + 1] == str(BUILTIN_TEMPLATES[CHATML_TOOLS])
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in argv
    plain = _argv(HourglassConfig(), tmp_path)  # unset: the folder's own template, no parser
    assert "--chat-template" not in plain and "--tool-call-parser" not in plain


def test_a_template_file_is_accepted_and_anything_else_refused_with_the_key(tmp_path: Path) -> None:
    own = tmp_path / "mine.jinja"
    own.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert ModelConfig(chat_template=str(own)).chat_template == str(own)
    for bad in ("chatml", str(tmp_path / "missing.jinja"), str(tmp_path)):
        with pytest.raises(ValidationError, match="chat_template"):
            ModelConfig(chat_template=bad)
    with pytest.raises(ValidationError, match="tool_call_parser"):
        HourglassConfig.model_validate({"serving": {"tool_call_parser": "hermes --trust-remote-code"}})


def test_the_trainer_renders_with_the_configured_template(tiny_model: Path, tmp_path: Path) -> None:
    from trainer.model.base import load_base

    own = tmp_path / "plain.jinja"
    own.write_text("{% for m in messages %}<<{{ m['role'] }}:{{ m['content'] }}>>{% endfor %}")
    base = load_base(ModelConfig(name=str(tiny_model), chat_template=str(own)))
    ids = base.prompt_ids([{"role": "user", "content": "hi"}], None, None)
    assert base.tokenizer.decode(ids).startswith("<<user:hi>>")


def test_the_embedded_vllm_decodes_as_many_sequences_as_configured(tmp_path: Path) -> None:
    argv = _argv(HourglassConfig(), tmp_path)
    assert argv[argv.index("--max-num-seqs") + 1] == "256"  # a round's rollouts and evaluation answers at once
    argv = _argv(HourglassConfig.model_validate({"serving": {"max_num_seqs": 32}}), tmp_path)
    assert argv[argv.index("--max-num-seqs") + 1] == "32"
    for bad in (0, -1, 10**6, "many"):
        with pytest.raises(ValidationError, match="max_num_seqs"):
            HourglassConfig.model_validate({"serving": {"max_num_seqs": bad}})
