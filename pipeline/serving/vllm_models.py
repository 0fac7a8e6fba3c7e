"""Can the installed vLLM serve a base model with LoRA adapters? (``hourglass models check``, ``hourglass up``)

vLLM picks the model class by ``config.json``'s ``architectures[0]`` in its model registry
(``vllm.model_executor.models.registry.ModelRegistry``); LoRA adapters load only into classes that implement
``SupportsLoRA`` (``vllm.model_executor.models.interfaces.supports_lora``). Both are read from the vLLM installed
here (the CPU build on a CPU machine), by importing the model's module only, without starting an engine.
"""

from __future__ import annotations

import logging
from pathlib import Path

from trainer.model import store as model_store

log = logging.getLogger(__name__)

# The architectures the test suite runs the whole path on (tests/conftest.py ARCHITECTURES: tiny random models
# built at test time, plus SmolLM2-135M for Llama): LoRA training, tied embeddings, tools, serving, hot-load,
# trainer vs vLLM log-probs, the reward-model head and one-pass training.
TESTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM"})


def vllm_problems(architecture: str) -> list[str]:
    """Why the installed vLLM cannot serve ``architecture`` with runtime LoRA adapters; empty when it can.

    Raises:
        ImportError: vLLM is not installed here.
    """
    import vllm
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    if architecture not in ModelRegistry.get_supported_archs():
        return [
            f"architecture {architecture} is not in the model registry of vLLM {vllm.__version__} installed here: "
            "it cannot serve this model"
        ]
    try:
        cls = ModelRegistry.models[architecture].load_model_cls()
    except Exception as err:  # a model module that does not import on this platform (e.g. a GPU-only kernel)
        return [f"vLLM {vllm.__version__} cannot load its {architecture} class here: {type(err).__name__}: {err}"]
    if not supports_lora(cls):
        return [
            f"vLLM {vllm.__version__} serves {architecture} but cannot load LoRA adapters into it (no SupportsLoRA): "
            "no trained adapter could be served"
        ]
    return []


def check_base_folder(folder: str | Path) -> tuple[model_store.FolderReport, list[str], list[str]]:
    """A local Hugging Face folder checked for training (:func:`trainer.model.store.inspect_folder`) and for serving
    (:func:`vllm_problems`): ``(report, problems, warnings)``. Problems make it unusable; warnings do not (an
    architecture the tests do not cover, a chat template that renders no tools, vLLM not installed here)."""
    report = model_store.inspect_folder(folder)
    problems, warnings = list(report.problems), []
    if report.architecture:
        try:
            problems += vllm_problems(report.architecture)
        except ImportError as err:
            warnings.append(f"vLLM is not installed here ({err}): whether it can serve the model is not checked")
        if report.architecture not in TESTED_ARCHITECTURES:
            warnings.append(
                f"{report.architecture} is not among the architectures the test suite covers "
                f"({', '.join(sorted(TESTED_ARCHITECTURES))}): check LoRA target_modules against its module names"
            )
    if report.chat_template and not report.template_offers_tools:
        warnings.append("the chat template renders no tools: requests with tools would be served without them")
    return report, problems, warnings
