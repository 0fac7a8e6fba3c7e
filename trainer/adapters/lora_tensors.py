"""LoRA tensors shared by the adapter stores and the multi-LoRA step: PEFT-keyed
parameters of one adapter, a candidate's start weights (fresh or from a saved
adapter of another rank), PEFT folders on disk, AdamW and its state.

Adapter tensors are keyed by PEFT's saved names (``...q_proj.lora_A.weight``,
the adapter name removed), so a saved folder loads in PEFT and in vLLM.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch

from trainer.model.base import ResidentBase, lora_config
from trainer.config import CandidateConfig
from trainer.errors import TrainerConfigError

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
SLOT = "hourglass-slot"  # the offload store's one live PEFT adapter


def adapter_params(model: torch.nn.Module, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The parameters of one PEFT adapter, keyed by PEFT's saved (adapter-free) names.

    Linear LoRA tensors are named ``...q_proj.lora_A.<adapter>.weight``;
    embedding LoRA tensors ``...embed_tokens.lora_embedding_A.<adapter>``.
    """
    marker, suffix = f".{adapter}.", f".{adapter}"
    out = {}
    for n, p in model.named_parameters():
        if marker in n:
            out[n.replace(marker, ".")] = p
        elif n.endswith(suffix):
            out[n[: -len(suffix)]] = p
    return out


def _seed_of(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) + seed) % (2**31)


def initial_weights(
    base: ResidentBase, name: str, candidate: CandidateConfig, init_dir: Path | None, seed: int
) -> dict[str, torch.Tensor]:
    """A candidate's starting LoRA weights on the CPU.

    From ``init_dir`` (a PEFT folder, e.g. the champion) when given, else PEFT's
    fresh init (A: Kaiming-uniform, B: zeros) seeded by ``(name, seed)`` so the
    same candidate starts identically whoever else is in the store. A saved
    adapter of another rank or alpha is converted by :func:`fit_adapter`, so a
    rank-16 challenger can start from a rank-8 champion and the other way round.

    Raises:
        TrainerConfigError: the folder is missing, or the saved adapter adapts
            modules the candidate does not target.
    """
    probe = f"hourglass-init-{zlib.crc32(name.encode())}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed_of(name, seed))
        base.model.add_adapter(probe, lora_config(candidate))
    try:
        fresh = {k: p.detach().to("cpu", copy=True) for k, p in adapter_params(base.model, probe).items()}
    finally:
        base.model.delete_adapter(probe)
    if init_dir is None:
        return fresh
    path = Path(init_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise TrainerConfigError(
            f"candidate {name!r}: start adapter {path} does not exist; use start='fresh' or fix the path"
        )
    loaded = safetensors.torch.load_file(str(path))
    unknown = sorted(set(loaded) - set(fresh))
    if unknown:
        raise TrainerConfigError(
            f"candidate {name!r}: adapter {path} adapts modules the candidate does not target ({unknown[:3]}...); "
            f"its target_modules {candidate.target_modules} must include the start adapter's, or use start='fresh'"
        )
    for key_a, key_b in lora_pairs(loaded):
        # A is [r, in], B is [out, r]: the rank may differ, the module's in/out sizes may not
        if loaded[key_a].shape[1] != fresh[key_a].shape[1] or loaded[key_b].shape[0] != fresh[key_b].shape[0]:
            raise TrainerConfigError(
                f"candidate {name!r}: start adapter {path} was not trained on this base model: {key_a} is "
                f"{tuple(loaded[key_a].shape)} / {key_b} is {tuple(loaded[key_b].shape)}, the base needs "
                f"[r, {fresh[key_a].shape[1]}] / [{fresh[key_b].shape[0]}, r]"
            )
    saved_scale = _lora_scale(Path(init_dir) / "adapter_config.json")
    return fit_adapter(loaded, fresh, saved_scale, candidate.lora_alpha / candidate.lora_rank, name)


def lora_pairs(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, str]]:
    """``(A key, B key)`` of every LoRA module in ``tensors`` (linear ``lora_A``/``lora_B``,
    embedding ``lora_embedding_A``/``lora_embedding_B``; PEFT's saved names).

    Raises:
        TrainerConfigError: an A without its B.
    """
    pairs = []
    for key_a in sorted(tensors):
        for a, b in ((".lora_A.", ".lora_B."), (".lora_embedding_A", ".lora_embedding_B")):
            if a in key_a:
                key_b = key_a.replace(a, b)
                if key_b not in tensors:
                    raise TrainerConfigError(f"adapter has {key_a} but no {key_b}")
                pairs.append((key_a, key_b))
    return pairs


def _lora_scale(config_path: Path) -> float:
    """PEFT's LoRA scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) of a saved adapter."""
    try:
        cfg = json.loads(config_path.read_text())
        rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TrainerConfigError(
            f"start adapter config {config_path} is missing or has no r / lora_alpha: {err}"
        ) from err
    return alpha / (rank**0.5 if cfg.get("use_rslora") else rank)


def fit_adapter(
    saved: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor], saved_scale: float, scale: float, name: str = "?"
) -> dict[str, torch.Tensor]:
    """Start weights of a new rank/alpha that reproduce a saved adapter's update.

    LoRA adds ``dW = s * B @ A`` per module (``A [r, in]``, ``B [out, r]``,
    ``s = alpha / r``; Hu et al. 2021, arXiv:2106.09685). For each module in
    ``saved``:

    - same rank: ``A`` kept, ``B`` rescaled by ``saved_scale / scale``; exact.
    - higher rank: the saved ``A`` fills the first rows and the remaining rows
      keep their fresh Kaiming init, ``B`` is zero in the new columns; the update
      is exact and the new directions still get gradients.
    - lower rank: the best rank-``r`` approximation of ``dW`` (truncated SVD,
      Eckart-Young), split evenly as ``A = sqrt(S) Vh``, ``B = U sqrt(S) / s``;
      lossy, and the relative error is logged.

    Modules only in ``fresh`` keep their fresh init (``B = 0``: no update).

    Args:
        saved: PEFT-keyed tensors of the saved adapter.
        fresh: the candidate's fresh tensors (defines the target shapes and dtype).
        saved_scale, scale: LoRA scaling of the saved adapter and of the candidate.
    """
    out = {k: v.clone() for k, v in fresh.items()}
    for key_a, key_b in lora_pairs(saved):
        a, b = saved[key_a].float(), saved[key_b].float()
        r_saved, r_new = a.shape[0], out[key_a].shape[0]
        if r_new >= r_saved:
            out[key_a][:r_saved] = a.to(out[key_a].dtype)
            out[key_b].zero_()
            out[key_b][:, :r_saved] = (b * (saved_scale / scale)).to(out[key_b].dtype)
            continue
        delta = saved_scale * (b @ a)
        u, sing, vh = torch.linalg.svd(delta, full_matrices=False)
        root = sing[:r_new].sqrt()
        out[key_a] = (root[:, None] * vh[:r_new]).to(fresh[key_a].dtype)
        out[key_b] = (u[:, :r_new] * root[None, :] / scale).to(fresh[key_b].dtype)
        lost = float(sing[r_new:].square().sum().sqrt() / sing.square().sum().sqrt().clamp_min(1e-12))
        log.info(
            "candidate %r: %s truncated from rank %d to %d (relative Frobenius error %.3f)",
            name,
            key_a,
            r_saved,
            r_new,
            lost,
        )
    return out


def write_adapter(
    weights: Mapping[str, torch.Tensor], candidate: CandidateConfig, base: ResidentBase, out_dir: Path
) -> Path:
    """Write a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = lora_config(candidate)
    config.base_model_name_or_path = str(base.path)
    config.save_pretrained(str(out_dir))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    safetensors.torch.save_file(tensors, str(out_dir / ADAPTER_WEIGHTS))
    return out_dir


def peft_name(name: str) -> str:
    """The PEFT adapter name of candidate ``name`` (``cand-<name>``: PEFT warns about adapter names that are substrings of 'lora_')."""
    return f"cand-{name}"


def set_trainable(model: torch.nn.Module, adapter: str | None) -> None:
    """Only ``adapter``'s parameters require gradients (none when ``adapter`` is None)."""
    for n, p in model.named_parameters():
        p.requires_grad_(
            adapter is not None and (f".{adapter}." in n or n.endswith(f".{adapter}"))
        )  # as adapter_params


def make_adamw(params: list[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    """One candidate's AdamW (Loshchilov & Hutter 2019, arXiv:1711.05101) over its LoRA tensors, no weight decay."""
    # foreach=None: PyTorch's choice, multi-tensor kernels on CUDA (one launch per
    # op for all LoRA tensors instead of one per tensor) and per-tensor on CPU.
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def snapshot_state(params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """CPU copies of one candidate's weights and AdamW state: ``weight/<key>``, ``exp_avg/<key>``,
    ``exp_avg_sq/<key>``, ``step/<key>`` (PEFT-keyed; the state fields only once a step ran)."""
    out = {f"weight/{k}": p.detach().to("cpu", copy=True) for k, p in params.items()}
    for k, p in params.items():
        state = optimizer.state.get(p, {})
        for field_name in ("exp_avg", "exp_avg_sq", "step"):
            if field_name in state:
                out[f"{field_name}/{k}"] = torch.as_tensor(state[field_name]).detach().to("cpu", copy=True)
    return out
