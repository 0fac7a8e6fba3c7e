"""Signatures, adapter_config validation, size caps and key handling (pure logic, no services)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from pipeline.config import HourglassConfig, load_config
from pipeline.errors import ConfigError
from pipeline.registry.signing import TAG_SIGNATURE, SignatureError, key_id, sign, signing_keys, verify
from pipeline.serving.staging import StagingError, base_module_names, check_adapter_config, verify_folder
from trainer.model.store import sha256_file

KEY = b"k" * 32
OTHER = b"o" * 32
MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "model.layers.0.self_attn.q_proj"})
TAGS = {
    "hourglass.round_id": "r1",
    "hourglass.candidate": "cand-a",
    "hourglass.base_fingerprint": "f" * 64,
    "hourglass.sha256": json.dumps({"adapter_model.safetensors": "a" * 64, "adapter_config.json": "b" * 64}),
}


def _signed(key: bytes = KEY, model: str = "m") -> dict[str, str]:
    return {**TAGS, TAG_SIGNATURE: sign(key, model, TAGS)}


def test_signature_verifies_and_names_its_key() -> None:
    assert verify([KEY], "m", _signed()) == key_id(KEY)
    assert verify([OTHER, KEY], "m", _signed()) == key_id(KEY)  # an old key still accepted during rotation
    # the checksum map is signed canonically: key order in the JSON does not matter
    reordered = {
        **_signed(),
        "hourglass.sha256": json.dumps(dict(reversed(json.loads(TAGS["hourglass.sha256"]).items()))),
    }
    assert verify([KEY], "m", reordered) == key_id(KEY)


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda t: t.pop(TAG_SIGNATURE), "has no hourglass.signature tag"),
        (lambda t: t.update({TAG_SIGNATURE: sign(OTHER, "m", TAGS)}), f"signed with key {key_id(OTHER)}"),
        (
            lambda t: t.update({"hourglass.sha256": json.dumps({"adapter_model.safetensors": "0" * 64})}),
            "does not match",
        ),
        (lambda t: t.update({"hourglass.base_fingerprint": "0" * 64}), "does not match"),
        (lambda t: t.update({"hourglass.round_id": "r2"}), "does not match"),
        (lambda t: t.update({"hourglass.candidate": "evil"}), "does not match"),
        (lambda t: t.update({TAG_SIGNATURE: "md5:abc:def"}), "malformed"),
        (lambda t: t.pop("hourglass.sha256"), "missing"),
    ],
    ids=["missing", "wrong-key", "checksums", "fingerprint", "round", "candidate", "scheme", "no-checksums"],
)
def test_tampered_or_foreign_signature_is_refused(tamper, message) -> None:
    tags = _signed()
    tamper(tags)
    with pytest.raises(SignatureError, match=message):
        verify([KEY], "m", tags)


def test_signature_is_bound_to_the_model_name() -> None:
    with pytest.raises(SignatureError, match="does not match"):
        verify([KEY], "other-model", _signed(model="m"))


def test_embedded_key_is_generated_private_and_stable(tmp_path: Path) -> None:
    cfg = load_config(None).model_copy(update={"state_dir": str(tmp_path)})
    [key] = signing_keys(cfg)
    path = tmp_path / "signing-key"
    assert path.read_text().encode() == key and len(key) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert signing_keys(cfg) == [key]


def test_configured_keys_win_and_production_needs_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOURGLASS_REGISTRY__SIGNING_KEY", "n" * 40)
    monkeypatch.setenv("HOURGLASS_REGISTRY__PREVIOUS_SIGNING_KEYS", json.dumps(["p" * 40]))
    cfg = HourglassConfig(state_dir=str(tmp_path))
    assert signing_keys(cfg) == [b"n" * 40, b"p" * 40]
    assert not (tmp_path / "signing-key").exists()
    monkeypatch.delenv("HOURGLASS_REGISTRY__SIGNING_KEY")
    with pytest.raises(ConfigError, match="HOURGLASS_REGISTRY__SIGNING_KEY"):
        signing_keys(HourglassConfig(state_dir=str(tmp_path), deployment="production"))
    monkeypatch.setenv("HOURGLASS_REGISTRY__SIGNING_KEY", "short")
    with pytest.raises(ConfigError) as err:
        load_config(None)
    problems = " ".join(err.value.problems)
    assert "registry.signing_key" in problems and "at least 32 characters" in problems
    assert "short" not in problems  # never echoed


# --- adapter_config.json ------------------------------------------------------------


def _config(**changes) -> dict:
    config = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "use_rslora": False,
        "use_dora": False,
        "target_modules": ["q_proj", "v_proj"],
        "modules_to_save": None,
        "bias": "none",
    }
    config.update(changes)
    return config


def test_plain_lora_config_passes() -> None:
    assert check_adapter_config(_config(), max_lora_rank=16, base_modules=MODULES) == 8
    assert check_adapter_config(_config(lora_alpha=8.5, use_rslora=True), max_lora_rank=16, base_modules=MODULES) == 8
    full_path = _config(target_modules=["model.layers.0.self_attn.q_proj"])
    assert check_adapter_config(full_path, max_lora_rank=16, base_modules=MODULES) == 8


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"r": -4}, "r=-4: the LoRA rank must be a positive integer"),
        ({"r": 0}, "r=0"),
        ({"r": 8.0}, "r=8.0"),
        ({"r": True}, "r=True"),
        ({"r": 32}, "r=32 exceeds the server's --max-lora-rank=16"),
        ({"lora_alpha": -1}, "lora_alpha=-1"),
        ({"lora_alpha": "16"}, "lora_alpha='16'"),
        ({"use_rslora": "yes"}, "use_rslora='yes'"),
        ({"use_rslora": 1}, "use_rslora=1"),
        ({"use_dora": True}, "DoRA"),
        ({"target_modules": ["q_proj", "evil_proj"]}, r"target_modules \['evil_proj'\] are not modules"),
        ({"target_modules": []}, "non-empty list"),
        ({"target_modules": ".*"}, "regex strings are refused"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "peft_type='IA3'"),
        ({"bias": "all"}, "bias='all'"),
        ({"rank_pattern": {"q_proj": 64}}, "rank_pattern"),
    ],
)
def test_bad_adapter_config_is_refused(changes, message) -> None:
    with pytest.raises(StagingError, match=message):
        check_adapter_config(_config(**changes), max_lora_rank=16, base_modules=MODULES)


def test_base_module_names_come_from_the_safetensors_headers(tiny_model: Path) -> None:
    names = base_module_names(tiny_model)
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= names
    assert "model.layers.0.self_attn.q_proj" in names
    assert "input_layernorm" not in names  # 1-D weights are not LoRA targets


def test_oversize_artifacts_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "m" / "v1"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps(_config()))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 5000)
    sums = {p.name: sha256_file(p) for p in folder.iterdir()}
    kwargs = dict(expected_fingerprint="f", fingerprint="f", max_lora_rank=16, base_modules=MODULES)
    assert verify_folder(tmp_path, folder, sums, max_adapter_bytes=10_000, **kwargs) == 8
    with pytest.raises(
        StagingError, match="'adapter_model.safetensors' is 5000 bytes, over serving.max_adapter_bytes=4096"
    ):
        verify_folder(tmp_path, folder, sums, max_adapter_bytes=4096, **kwargs)
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 3000)
    sums = {p.name: sha256_file(p) for p in folder.iterdir()}
    with pytest.raises(StagingError, match="total .* over serving.max_adapter_bytes=3100"):
        verify_folder(tmp_path, folder, sums, max_adapter_bytes=3100, **kwargs)
