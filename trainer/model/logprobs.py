"""Completion log-probs: :func:`token_logprobs` of logits, and a pass with each distinct prompt run once,
however many rows repeat it (:func:`shared_prompt_logprobs`).

A GRPO step has ``G`` rollouts of every prompt, and every candidate of a step
rolls out the same prompts, so most of a batch's tokens are repeated prompts
(the demo's task: ~64 prompt tokens and <= 16 completion tokens a row). The
plain pass (:meth:`trainer.model.base.ResidentBase.completion_logprobs` with sharing
off) runs every row's prompt again. Here a pass is two forwards through the
same model:

1. **prompts**: the distinct prompts (rows whose ``key`` and prompt are equal
   share one), left-padded ``[U, Lp]``, with the KV cache kept; the logits at
   each prompt's last position predict its rows' first completion token;
2. **completions**: every row's completion tokens but the last ``[B, T-1]``,
   right-padded, attending to its prompt's cached keys and values (the cache
   rows gathered to ``[B, ...]`` by :meth:`transformers.DynamicCache.batch_select_indices`,
   which autograd follows, so gradients reach the prompt forward once per distinct
   prompt), positions continuing after each prompt.

Distinct prompts that open alike (a system prompt; the chat template's own
system turn is 26 of the demo's 43 prompt tokens) first run that shared prefix
(:func:`common_prefix_length`) once per key, ``[keys, S]``, its cache gathered
to the prompts; step 1 then runs each prompt's rest ``[U, Lp - S]``.

The result equals the plain pass up to float rounding (tested in float32 on
the log-probs and on the LoRA gradients): the same causal attention over the
same tokens at the same positions, in another order of operations. What it
saves is the prompt tokens of the repeated rows: ``B x Lp`` prompt tokens
become ``U x Lp`` (``keys x S + U x (Lp - S)`` with a shared prefix).

``key`` separates rows that must not share even with equal prompts: rows that
go through different LoRA adapters in one pass (:class:`trainer.multi_lora.layer.MultiLoRA`).
``rows`` is the hook that switches such per-row adapters: called with the rows
of each of the two forwards (indices into the batch), it returns the context
to run that forward in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from typing import ContextManager

import torch
from transformers import DynamicCache


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """log pi(target_t | prefix) for every position: ``[B, T, V] , [B, T] -> [B, T]``.

    ``logits_BTV[:, t]`` must be the logits that predict ``targets_BT[:, t]``
    (the caller shifts by one). Computed in float32.
    """
    logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    return logp_BTV.gather(-1, targets_BT.long().unsqueeze(-1)).squeeze(-1)


RowsContext = Callable[[Sequence[int]], ContextManager[object]]
"""Given the batch rows one forward runs (indices into the batch, in the forward's row order), the context to run it in."""


def no_rows_context(rows: Sequence[int]) -> ContextManager[object]:
    """The default :data:`RowsContext`: nothing to switch per row."""
    return contextlib.nullcontext()


def distinct_prompts(
    prompt_ids: Sequence[Sequence[int]], keys_B: Sequence[Hashable] | None = None
) -> tuple[list[int], list[int]]:
    """Which rows share a prompt forward.

    Returns:
        ``(owner_B, first_U)``: ``owner_B[b]`` is the index ``u`` of row ``b``'s
        distinct prompt, ``first_U[u]`` the first row with it; distinct prompts
        are numbered in order of first appearance (rows grouped by key stay grouped).
    """
    seen: dict[tuple[Hashable, tuple[int, ...]], int] = {}
    owner_B: list[int] = []
    first_U: list[int] = []
    for b, prompt in enumerate(prompt_ids):
        key = (None if keys_B is None else keys_B[b], tuple(prompt))
        u = seen.get(key)
        if u is None:
            u = seen[key] = len(first_U)
            first_U.append(b)
        owner_B.append(u)
    return owner_B, first_U


def common_prefix_length(seqs: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every sequence shares, at most the shortest's length - 1 (each keeps a token of its
    own: a prompt's last token predicts its completion's first, a reward model scores a row's last token); 0 for
    fewer than two sequences."""
    if len(seqs) < 2:
        return 0
    shared = 0
    for column in zip(*seqs):
        if any(token != column[0] for token in column):
            break
        shared += 1
    return min(shared, min(len(s) for s in seqs) - 1)


MIN_PREFIX_TOKENS_SAVED = 64
"""A shared prefix runs as its own forward only when that saves at least this many tokens: a forward has a fixed
cost. Measured on the 2-core dev host (SmolLM2-135M, float32, no grad): 59 ms for one token, 104 ms for 26, 612
ms for 8 x 43, about 1.6 ms a token beyond a fixed ~55 ms, so one more forward costs about what 35 tokens do."""


def worth_sharing(seqs: Sequence[Sequence[int]], groups: int = 1) -> int:
    """The :func:`common_prefix_length` of ``seqs`` when running it once per group (a LoRA adapter's rows are a
    group) instead of once per sequence saves at least :data:`MIN_PREFIX_TOKENS_SAVED` tokens, else 0."""
    shared = common_prefix_length(seqs)
    return shared if (len(seqs) - groups) * shared >= MIN_PREFIX_TOKENS_SAVED else 0


def shared_prompt_logprobs(
    model: torch.nn.Module,
    pad_id: int,
    device: torch.device,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    owner_B: Sequence[int],
    first_U: Sequence[int],
    rows: RowsContext = no_rows_context,
    keys_B: Sequence[Hashable] | None = None,
    prefix: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each completion token, each distinct prompt run once (see the module docstring).

    ``owner_B`` / ``first_U`` from :func:`distinct_prompts` (with the same ``keys_B``); every prompt must
    have at least one token. ``prefix``: the tokens every distinct prompt opens with
    (:func:`common_prefix_length` of them), run once per key before the prompts' rest. Gradients flow as in
    one plain forward.

    Returns:
        ``(logprobs_BT, mask_BT)``, ``T`` = the longest completion (at least 1),
        column ``t`` = completion token ``t``; the mask is 1.0 on real tokens.
    """
    B, U, S = len(prompt_ids), len(first_U), prefix
    lens_p = [len(prompt_ids[b]) for b in first_U]
    lens_c = [len(c) for c in completion_ids]
    T, Lp = max(1, max(lens_c)), max(lens_p) - S  # Lp: the longest prompt after the shared prefix
    prompt_UL = torch.full((U, Lp), pad_id, dtype=torch.long)
    prompt_mask_UL = torch.zeros((U, Lp), dtype=torch.long)
    for u, b in enumerate(first_U):
        prompt_UL[u, Lp - lens_p[u] + S :] = torch.tensor(list(prompt_ids[b][S:]), dtype=torch.long)
        prompt_mask_UL[u, Lp - lens_p[u] + S :] = 1
    targets_BT = torch.full((B, T), pad_id, dtype=torch.long)
    for b, c in enumerate(completion_ids):
        if c:
            targets_BT[b, : len(c)] = torch.tensor(list(c), dtype=torch.long)
    mask_BT = (torch.arange(T).unsqueeze(0) < torch.tensor(lens_c).unsqueeze(1)).float()
    owner = torch.tensor(list(owner_B), dtype=torch.long)

    cache = DynamicCache()
    if S:
        # 0. the shared prefix, once per key (a key's adapter changes its keys and values), gathered to the prompts
        group: dict[Hashable, int] = {}
        lead: list[int] = []  # the batch row that runs each key's prefix
        group_U = []
        for b in first_U:
            key = None if keys_B is None else keys_B[b]
            if key not in group:
                group[key] = len(lead)
                lead.append(b)
            group_U.append(group[key])
        G = len(lead)
        with rows(lead):
            model(
                input_ids=torch.tensor([list(prompt_ids[first_U[0]][:S])] * G, dtype=torch.long, device=device),
                position_ids=torch.arange(S, device=device).unsqueeze(0).expand(G, S),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        cache.batch_select_indices(torch.tensor(group_U, dtype=torch.long, device=device))
        prompt_mask_UL = torch.cat([torch.ones((U, S), dtype=torch.long), prompt_mask_UL], dim=1)

    # 1. the distinct prompts (after the prefix), left-padded; the last column's logit predicts each row's first token
    with rows(list(first_U)):
        out = model(
            input_ids=prompt_UL.to(device),
            attention_mask=prompt_mask_UL.to(device),
            position_ids=(prompt_mask_UL.cumsum(1) - 1).clamp(min=0)[:, S:].to(device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=torch.tensor([Lp - 1], device=device),  # an index tensor: a contiguous [U, 1, H]
        )
    first_UV = torch.log_softmax(out.logits[:, 0].float(), dim=-1)
    first_B1 = first_UV[owner.to(device), targets_BT[:, 0].to(device)].unsqueeze(1)
    if T == 1:
        return first_B1 * mask_BT.to(device), mask_BT.to(device)

    # 2. every row's completion but its last token, after its prompt's cached keys/values
    cache.batch_select_indices(owner.to(device))
    inputs_BT = targets_BT[:, : T - 1]
    attn = torch.cat([prompt_mask_UL[owner], mask_BT[:, : T - 1].long()], dim=1)
    positions_BT = torch.tensor(lens_p)[owner].unsqueeze(1) + torch.arange(T - 1).unsqueeze(0)
    with rows(list(range(B))):
        out = model(
            input_ids=inputs_BT.to(device),
            attention_mask=attn.to(device),
            position_ids=positions_BT.to(device),
            past_key_values=cache,
            use_cache=True,
        )
    rest_BT = token_logprobs(out.logits, targets_BT[:, 1:].to(device))  # position t predicts token t + 1
    logprobs_BT = torch.cat([first_B1, rest_BT], dim=1) * mask_BT.to(device)
    return logprobs_BT, mask_BT.to(device)
