"""The resident base model: loaded once, frozen, wrapped by PEFT so LoRA
adapters can be attached per candidate.

The reference policy for the KL penalty is this same model with adapters
disabled (``with base.reference():``), so no second copy of the weights
exists (or, for a candidate with ``reference = "start"``, its own adapter's
start weights: :class:`trainer.algorithms.update.StartReference`). Source of the adapter API: PEFT ``PeftModel`` (``add_adapter``,
``set_adapter``, ``delete_adapter``, ``disable_adapter``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from trainer import chat
from trainer.errors import ModelStoreError, TrainerConfigError
from trainer.model import store as model_store
from trainer.config import CandidateConfig, ModelConfig
from trainer.model.logprobs import token_logprobs
from trainer.templates import template_path
from trainer.model.logprobs import (
    RowsContext,
    distinct_prompts,
    no_rows_context,
    shared_prompt_logprobs,
    worth_sharing,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BOOT_ADAPTER = "hourglass-boot"  # PEFT needs one adapter to build the wrapper; never trained
EAGER_ATTENTION_MAX_TOKENS = 256
"""On CPU, passes whose longest row (prompt + completion) has at most this many tokens run transformers' eager
attention instead of SDPA. Measured on the 2-core dev host (SmolLM2-135M, bf16, one-pass steps of K = 4 to 8
candidates): torch's CPU flash-attention backward made a step of 43 + 12 token rows 15-20 % slower than eager
attention, and eager was still ahead at 400 + 64 tokens. Eager keeps each layer's ``[rows, heads, T, T]``
attention weights for backward, which grows with ``T`` at a fixed ``rl.update.chunk_tokens``; at this bound it
stays below the chunk's other activations. On CUDA, SDPA's fused kernels stay."""


def lora_config(candidate: CandidateConfig) -> LoraConfig:
    """The PEFT LoRA config of a candidate (rank r, alpha, target modules; no dropout)."""
    return LoraConfig(
        r=candidate.lora_rank,
        lora_alpha=candidate.lora_alpha,
        target_modules=list(candidate.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def cpu_has_bf16() -> bool:
    """True when the CPU has bf16 matmul instructions (``amx_bf16`` or ``avx512_bf16`` in /proc/cpuinfo flags)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    """The base's dtype: an explicit choice as given; ``auto`` -> bfloat16 on CUDA with bf16 support
    (``torch.cuda.is_bf16_supported``) and on CPUs with :func:`cpu_has_bf16`, float32 otherwise."""
    if choice != "auto":
        return _DTYPES[choice]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if device.type == "cpu" and cpu_has_bf16() else torch.float32


def pick_device(choice: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def chat_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Prompt token ids of ``messages`` (1-D): the tokenizer's chat template with the generation prompt and
    the ``tools`` offered, rendered as vLLM renders a chat request (:func:`trainer.chat.prompt_token_ids`)."""
    return chat.prompt_token_ids(tokenizer, messages, tools)


@dataclass
class ResidentBase:
    """The base model (PEFT-wrapped, base weights frozen), its tokenizer and where it lives."""

    model: PeftModel
    tokenizer: PreTrainedTokenizerBase
    path: Path
    fingerprint: str
    device: torch.device
    max_seq_len: int
    share_prompts: bool = (
        True  # run each distinct prompt of a pass once (trainer.model.logprobs); False: every row whole
    )

    def chat_token_ids(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Prompt token ids: the tokenizer's chat template with the generation prompt (and ``tools``)."""
        return chat_token_ids(self.tokenizer, messages, tools)

    def embeddable(self, ids: Sequence[int] | None) -> bool:
        """``ids`` is non-empty and the base can embed every one (``0 <= id < vocab``). Logged ids come from
        traffic (ingest accepts any int32), and one id the embedding table lacks would fail the whole round
        (an IndexError; a device assert on CUDA)."""
        if not ids:
            return False
        vocab = self.model.get_input_embeddings().num_embeddings
        return all(0 <= t < vocab for t in ids)

    def prompt_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        logged_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """A turn's prompt ids: the logged ids as vLLM served them when the base can embed every one (never a
        second rendering), else ``messages`` and the ``tools`` offered rendered by :meth:`chat_token_ids`."""
        if logged_ids is not None and self.embeddable(logged_ids):
            return list(logged_ids)
        return self.chat_token_ids(messages, tools)

    def completion_ids(
        self,
        text: str,
        logged_ids: Sequence[int] | None,
        *,
        messages: Sequence[Mapping[str, Any]] = (),
        tool_calls: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Completion token ids: the logged ids when the base can embed every one (:meth:`embeddable`);
        else an answer with ``tool_calls`` rendered by the chat template after ``messages``
        (:func:`trainer.chat.answer_token_ids`, through the end-of-turn token), else ``text`` tokenised as text:
        one that spells a control token (``<|im_end|>``, e.g. in a user's correction) gets that token's characters,
        never a turn boundary."""
        if logged_ids and self.embeddable(logged_ids):
            return list(logged_ids)
        if tool_calls:
            answer = {"role": "assistant", "content": text, "tool_calls": list(tool_calls)}
            rendered = chat.answer_token_ids(self.tokenizer, messages, answer, tools)
            if rendered:
                return rendered
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def target_module_problems(self, owner: str, target_modules: Sequence[str]) -> list[str]:
        """Why ``target_modules`` of ``owner`` (a candidate or the reward model) cannot be trained and served on
        this base; empty when they can.

        Every name must be a linear or embedding module of the base, by leaf name (``q_proj``) or full path:
        PEFT adapts the names that match and silently skips the others as long as one matches, so a name of
        another architecture (GPT-2's ``c_attn`` beside ``q_proj``) would train less than configured. A tied LM
        head (``tie_word_embeddings``: Qwen2 <= 3B, Gemma, SmolLM2) is refused: it is the input embedding, absent
        from the folder's safetensors, and staging refuses an adapter on it before vLLM would load it.
        """
        lm: Any = self.model.get_base_model()  # a transformers model; PEFT types it as a plain nn.Module
        kinds = (torch.nn.Linear, torch.nn.Embedding)
        names: set[str] = set()
        for path, module in lm.named_modules():
            if any(part == "base_layer" or part.startswith("lora_") for part in path.split(".")):
                continue  # PEFT's own layers inside an adapted module
            if isinstance(module, kinds) or isinstance(getattr(module, "base_layer", None), kinds):
                names.update((path, path.rsplit(".", 1)[-1]))
        problems = []
        unknown = sorted(set(target_modules) - names)
        if unknown:
            leaves = sorted(n for n in names if "." not in n)
            problems.append(
                f"{owner}: target_modules {unknown} are not modules of the base model "
                f"({type(lm).__name__}); its linear and embedding modules: {leaves}"
            )
        head = lm.get_output_embeddings()
        tied = head is not None and head.weight is lm.get_input_embeddings().weight
        head_names = {path for path, module in lm.named_modules() if module is head}
        head_names |= {n.rsplit(".", 1)[-1] for n in head_names}
        if tied and head_names & set(target_modules):
            problems.append(
                f"{owner}: target_modules {sorted(head_names & set(target_modules))} is the LM head, which this base "
                "ties to its input embedding (tie_word_embeddings): vLLM cannot serve a LoRA on it; leave it out"
            )
        return problems

    def check_targets(self, owners: Mapping[str, Sequence[str]]) -> None:
        """Every owner's (candidates', the reward model's) ``target_modules`` can be trained and served on this
        base (:meth:`target_module_problems`).

        Raises:
            TrainerConfigError: listing every problem of every owner at once.
        """
        problems = [p for owner, targets in owners.items() for p in self.target_module_problems(owner, targets)]
        if problems:
            raise TrainerConfigError("; ".join(problems))

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The reference policy: the base with every adapter disabled (no weight copy)."""
        with self.model.disable_adapter():
            yield

    def completion_logprobs(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        *,
        keys_B: Sequence[Hashable] | None = None,
        rows: RowsContext = no_rows_context,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of each completion token under the active adapter (with grad).

        When rows repeat a prompt (and ``share_prompts``), each distinct prompt
        (per ``keys_B[b]``: rows of different keys never share) runs once and
        its rows continue from its KV cache (:mod:`trainer.model.logprobs`; equal
        up to float rounding). Otherwise the sequences are left-padded into one
        batch ``[B, L]`` (position ids from the attention mask, as ``generate``
        does). ``rows`` gives the context of each forward from the batch rows it
        runs (:data:`trainer.model.logprobs.RowsContext`: per-row LoRA adapters).

        Returns:
            ``(logprobs_BT, mask_BT)`` with ``T`` = longest completion; column
            ``t`` is completion token ``t``; mask is 1.0 on real completion tokens.
        """
        longest = max((len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)), default=0)
        with self.attention_for(longest):
            return self._completion_logprobs(prompt_ids, completion_ids, keys_B, rows)

    @contextlib.contextmanager
    def attention_for(self, longest: int) -> Iterator[None]:
        """Eager attention for a short CPU pass of an SDPA model (:data:`EAGER_ATTENTION_MAX_TOKENS`), else as loaded."""
        if (
            self.device.type != "cpu"
            or longest > EAGER_ATTENTION_MAX_TOKENS
            or getattr(self.model.config, "_attn_implementation", None) != "sdpa"
            or not _can_switch_attention(self.model.get_base_model())
        ):
            yield
            return
        self.model.set_attn_implementation("eager")
        try:
            yield
        finally:
            self.model.set_attn_implementation("sdpa")

    def _completion_logprobs(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        keys_B: Sequence[Hashable] | None,
        rows: RowsContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if self.share_prompts and all(prompt_ids):
            owner_B, first_U = distinct_prompts(prompt_ids, keys_B)
            groups = len({None if keys_B is None else keys_B[b] for b in first_U})
            prefix = worth_sharing([prompt_ids[b] for b in first_U], groups)
            window = attention_window(self.model.get_base_model()) if prefix else None
            if window is not None and max(map(len, prompt_ids)) + max(map(len, completion_ids)) >= window:
                # a sliding window bounds distances between cache slots, not positions: the left pads between
                # a short prompt's prefix and its rest would push prefix tokens out of the window
                prefix = 0
            if len(first_U) < len(prompt_ids) or prefix:
                return shared_prompt_logprobs(
                    self.model, pad, self.device, prompt_ids, completion_ids, owner_B, first_U, rows, keys_B, prefix
                )
        B = len(prompt_ids)
        lens_c = [len(c) for c in completion_ids]
        T = max(1, max(lens_c))
        L = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
        # Left padding: every sequence ends at column L-1, so the logits that
        # predict completion tokens are among the last T+1 positions and the
        # LM head runs only there (logits_to_keep), not over the prompts. The
        # positions go as an index tensor, which gathers a contiguous [B, T+1, H]
        # copy: an int makes transformers slice hidden[:, -(T+1):], a strided
        # view that torch's matmul broadcasts against the LM head's weight by
        # materialising one [H, V] copy of it per row (measured on CPU: ~56 MB
        # per row for SmolLM2 in bf16, and ~15x slower).
        input_BL = torch.full((B, L), pad, dtype=torch.long)
        attn_BL = torch.zeros((B, L), dtype=torch.long)
        targets_BT = torch.full((B, T), pad, dtype=torch.long)  # right-aligned completion tokens
        for b, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
            seq = list(p) + list(c)
            input_BL[b, L - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            attn_BL[b, L - len(seq) :] = 1
            if c:
                targets_BT[b, T - len(c) :] = torch.tensor(list(c), dtype=torch.long)
        position_BL = (attn_BL.cumsum(1) - 1).clamp(min=0)  # positions as in generate() with left padding
        with rows(list(range(B))):
            out = self.model(
                input_ids=input_BL.to(self.device),
                attention_mask=attn_BL.to(self.device),
                position_ids=position_BL.to(self.device),
                logits_to_keep=torch.arange(L - T - 1, L, device=self.device),
                use_cache=False,  # no KV cache: nothing is generated after this pass
            )
        logits_BTV = out.logits[:, :T]  # position j predicts token j+1
        right_BT = token_logprobs(logits_BTV, targets_BT.to(self.device))
        # back to left-aligned: column t of row b is completion token t
        lens_B1 = torch.tensor(lens_c, dtype=torch.long).unsqueeze(1)
        cols_BT = torch.arange(T).unsqueeze(0)
        mask_BT = (cols_BT < lens_B1).float()
        index_BT = (T - lens_B1 + cols_BT).clamp(max=T - 1)
        logprobs_BT = right_BT.gather(1, index_BT.to(self.device)) * mask_BT.to(self.device)
        return logprobs_BT, mask_BT.to(self.device)


def attention_window(model: Any) -> int | None:
    """The sliding window of the model's sliding-attention layers (Gemma 3's local layers, Mistral's, Qwen2's with
    ``use_sliding_window``), None when every layer attends to the whole sequence."""
    text = model.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    if not window:
        return None
    types = getattr(text, "layer_types", None)
    if types is not None:
        return int(window) if any(t == "sliding_attention" for t in types) else None
    return int(window) if getattr(text, "use_sliding_window", True) else None


def _can_switch_attention(model: object) -> bool:
    """Whether transformers can switch this model's attention implementation between passes (cached per class)."""
    can = getattr(model, "_can_set_attn_implementation", None)
    return bool(callable(can) and can())


def load_base(cfg: ModelConfig, boot_candidate: CandidateConfig | None = None) -> ResidentBase:
    """Load the base model once, freeze it and wrap it with PEFT.

    ``cfg.name`` is resolved with :func:`trainer.model.store.resolve` (packaged
    key or folder). The wrapper is built with an untrained boot adapter
    (``BOOT_ADAPTER``) because PEFT needs one; the adapter store adds the
    candidates' adapters.

    Raises:
        UnknownModelError, ModelStoreError: from ``model_store.resolve``; ModelStoreError: the folder has no
            safetensors weights (pickles are never loaded).
    """
    path = model_store.resolve(cfg.name, cfg.cache_dir)
    if not any(path.glob("*.safetensors")):  # pickled weights (*.bin, *.pt) can run code: never loaded
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"))
        raise ModelStoreError(
            f"base model {path} has no *.safetensors weights{f' (found {found})' if found else ''}: only safetensors "
            "load; convert it (hourglass models check names how)"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    template = template_path(cfg.chat_template)
    if template is not None:  # the template vLLM serves with too (serving's --chat-template)
        tokenizer.chat_template = template.read_text()
    device = pick_device(cfg.device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=pick_dtype(cfg.dtype, device), use_safetensors=True)
    module: torch.nn.Module = model  # transformers types its `to` override so that mypy rejects the call
    module.to(device)  # in place
    return wrap_base(model, tokenizer, path, model_store.fingerprint_of(path), cfg.max_seq_len, boot_candidate)


class KeptBase:
    """A resident base kept between rounds (``rl.keep_base``): the always-on service's rounds after the first
    skip loading the model. The first round that asks loads it; a later round with the same model config gets
    the same one back, in eval mode (as loaded) and with only the boot adapter on it (every round's store
    removes its adapters when it closes). A round that failed, or left an adapter behind, drops it: the next
    round loads a fresh one. Rounds run one at a time (the service's round lock), so this is not thread-safe."""

    def __init__(self) -> None:
        self._cfg: ModelConfig | None = None
        self._base: ResidentBase | None = None

    def holds(self, cfg: ModelConfig) -> bool:
        """Whether a base for ``cfg`` is kept now (the next :meth:`get` of ``cfg`` reuses it)."""
        return self._base is not None and self._cfg == cfg

    def get(self, cfg: ModelConfig) -> ResidentBase:
        """The kept base for ``cfg``, loaded now (:func:`load_base`) when none is kept or its config differs."""
        base = self._base
        if base is None or not self.holds(cfg):
            self.drop()
            base = load_base(cfg)
            self._base, self._cfg = base, cfg.model_copy()
        base.model.eval()
        return base

    def release(self, ok: bool) -> None:
        """After a round: keep the base when the round succeeded and left it clean, else drop it."""
        if self._base is None:
            return
        adapters = set(self._base.model.peft_config)
        if not ok or adapters != {BOOT_ADAPTER}:
            self.drop()

    def drop(self) -> None:
        """Forget the kept base (its memory goes back when nothing else holds it)."""
        self._cfg, self._base = None, None


def wrap_base(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    path: Path,
    fingerprint: str,
    max_seq_len: int,
    boot_candidate: CandidateConfig | None = None,
) -> ResidentBase:
    """Freeze a loaded causal LM (already on its device) and wrap it with PEFT.

    :func:`load_base` calls this on a model from disk; benchmarks call it on a
    randomly initialised model of a given shape. The tokenizer gets its EOS
    token as pad token when it has none.
    """
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.requires_grad_(False)
    model.config.use_cache = True
    boot = boot_candidate or CandidateConfig(name="boot", lora_rank=1, target_modules=["q_proj"])
    # autocast_adapter_dtype (PEFT's default, spelled out): LoRA weights of a bf16/fp16 base are
    # created in float32, so their gradients and AdamW state are float32 too; PEFT casts each LoRA
    # layer's input to the LoRA weights' dtype and its output back to the base layer's.
    peft_model = get_peft_model(model, lora_config(boot), adapter_name=BOOT_ADAPTER, autocast_adapter_dtype=True)
    peft_model.requires_grad_(False)
    return ResidentBase(
        model=peft_model,
        tokenizer=tokenizer,
        path=path,
        fingerprint=fingerprint,
        device=next(model.parameters()).device,
        max_seq_len=max_seq_len,
    )
