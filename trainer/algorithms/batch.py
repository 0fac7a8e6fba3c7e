"""What every algorithm's step works with: the :class:`Batch` its builder makes, the :class:`StepData` it is
built from, the :class:`LossInputs` its policy loss reads, and the base-window helpers of logged completions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from trainer import chat
from trainer.config import CandidateConfig, RLConfig
from trainer.model.base import ResidentBase
from trainer.rewards import RewardMix
from trainer.tool_calls import answer_text
from trainer.types import Prompt, Sample


@dataclass(frozen=True)
class Batch:
    """B sequences ready for the loss. ``behaviour_logprobs[b]`` has one entry per completion token
    (empty for ``kto``, which needs none); ``desirable[b]`` is the KTO label (None for other algorithms)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]
    advantages: list[float]
    rewards: list[float]
    versions: list[str]
    desirable: list[bool] | None = None


Advantages = Callable[[torch.Tensor], torch.Tensor]
"""Rewards ``rewards_PG`` (``P`` prompts x ``G`` samples) -> advantages of the same shape."""


@dataclass(frozen=True)
class StepData:
    """What one candidate learns from in one step: the step's prompts (online: with their rollout
    ``groups``, ``P`` prompts x ``G`` samples) or logged rows (offline: ``groups`` is None)."""

    candidate: CandidateConfig
    prompts: Sequence[Prompt]
    prompt_ids: Sequence[list[int]]
    groups: Sequence[Sequence[Sample]] | None
    base: ResidentBase
    reward: RewardMix
    extra_metadata_PG: Sequence[Sequence[dict]] | None = (
        None  # online: per-sample metadata for the reward (e.g. reward_model_score)
    )


@dataclass(frozen=True)
class LossInputs:
    """The policy loss's inputs: log-probs of the batch's completion tokens under the live adapter
    (``logprobs_BT``, with grad) and the reference (``ref_BT``), and the mask ``mask_BT``. ``reference``
    runs a block under the reference policy (a loss that needs more of its log-probs, as KTO's reference point):
    the base with adapters off when None."""

    base: ResidentBase
    candidate: CandidateConfig
    rl: RLConfig
    batch: Batch
    logprobs_BT: torch.Tensor
    ref_BT: torch.Tensor
    mask_BT: torch.Tensor
    reference: Callable[[], AbstractContextManager[None]] | None = None

    def reference_policy(self) -> AbstractContextManager[None]:
        """A block under the reference policy (:attr:`reference`, or the base with adapters off)."""
        return self.reference() if self.reference is not None else self.base.reference()


PolicyLoss = Callable[[LossInputs], tuple[torch.Tensor, dict[str, float]]]


def fit_after(base: ResidentBase, prompt_ids: Sequence[int], completion_ids: list[int]) -> list[int]:
    """``completion_ids`` cut to fit ``base.max_seq_len`` after the prompt (at least one token): a logged
    completion or a correction from traffic can be far longer than the model's window."""
    return completion_ids[: max(1, base.max_seq_len - len(prompt_ids))]


def logged_ids(base: ResidentBase, p: Prompt) -> list[int]:
    """The logged completion's token ids: the logged ids when the base can embed every one, else a tool-call
    answer rendered by the chat template after the conversation, else the text tokenised (see
    :meth:`ResidentBase.completion_ids`); EOS for an empty completion."""
    ids = base.completion_ids(
        p.logged_completion or "",
        p.logged_token_ids,
        messages=p.messages,
        tool_calls=p.logged_tool_calls,
        tools=p.tools,
    )
    return ids or [base.tokenizer.eos_token_id]


def answer_ids(base: ResidentBase, p: Prompt, text: str) -> list[int]:
    """``text`` as a complete assistant answer after ``p``'s conversation: rendered by the chat template through
    its end-of-turn token (:func:`trainer.chat.answer_token_ids`), as a served answer ends. For answers nobody
    served, such as a user's correction: compared with served answers, which end in the end-of-turn token, a
    correction without it would differ by that token alone.

    The text is the user's, so it stays text: one that spells a control token (``<|im_end|>``...) is tokenised
    as plain characters, never as a turn boundary, and then EOS; so is one after a conversation the template
    cannot render (no messages, roles it refuses)."""
    tokenizer = base.tokenizer
    if not any(token in text for token in _control_tokens(tokenizer)):
        try:
            rendered = chat.answer_token_ids(tokenizer, p.messages, {"role": "assistant", "content": text}, p.tools)
        except (TemplateError, TypeError, ValueError):
            rendered = None
        if rendered:
            return rendered
    plain = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [*plain, tokenizer.eos_token_id]


def _control_tokens(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """The tokenizer's special tokens as text (``<|im_end|>``, ``<|im_start|>``...)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {str(t) for t in tokenizer.all_special_tokens} | {t.content for t in added.values() if t.special}


def logged_text(p: Prompt) -> str:
    """The logged answer as its rewards read it: the completion text, with its tool calls as Hermes blocks
    (:func:`trainer.tool_calls.answer_text`; the text alone on rows without calls)."""
    return answer_text(p.logged_completion or "", p.logged_tool_calls)


def pad_rows(rows: Sequence[Sequence[float]], T: int, device: torch.device) -> torch.Tensor:
    out_BT = torch.zeros((len(rows), T), dtype=torch.float32)
    for b, row in enumerate(rows):
        out_BT[b, : len(row)] = torch.tensor(list(row)[:T], dtype=torch.float32)
    return out_BT.to(device)
