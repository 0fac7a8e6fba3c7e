"""Measurements on held-out rows: greedy answers of many adapter versions in one engine call, the base's
log-probs of those answers (adapters off, each prompt once), the k3 KL of what is served to the base,
sequence log-probs under the live adapter or the reference, and a reward mix's score of answers."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.algorithms.losses import kl_k3, sequence_logprobs
from trainer.config import RLConfig
from trainer.errors import RolloutError
from trainer.model.base import ResidentBase
from trainer.rewards import RewardMix
from trainer.rollout.engine import RolloutEngine
from trainer.types import RolloutRequest
from trainer.types import Prompt, Sample


@dataclass(frozen=True)
class GreedySet:
    """Prompts that some versions answer greedily: ``prompt_ids[i]`` are ``prompts[i]``'s token ids;
    answers are at most ``max_new_tokens`` tokens."""

    versions: Sequence[str]
    prompts: Sequence[Prompt]
    prompt_ids: Sequence[list[int]]
    max_new_tokens: int


def greedy_sets(engine: RolloutEngine, sets: Sequence[GreedySet], seed: int) -> list[dict[str, list[Sample]]]:
    """Greedy completions of every set's versions on its prompts, all sets in one engine call (the engine
    batches them). Returns per set ``{version: [answer to prompts[i]]}``."""
    keys: list[tuple[int, str]] = []
    requests: list[RolloutRequest] = []
    for k, one in enumerate(sets):
        for v in one.versions:
            for p, ids in zip(one.prompts, one.prompt_ids, strict=True):
                keys.append((k, v))
                requests.append(
                    RolloutRequest(
                        version=v,
                        prompt_id=p.prompt_id,
                        prompt_token_ids=tuple(ids),
                        n=1,
                        max_new_tokens=one.max_new_tokens,
                        temperature=0.0,
                        seed=seed,
                    )
                )
    groups = engine.generate(requests) if requests else []
    out: list[dict[str, list[Sample]]] = [{v: [] for v in one.versions} for one in sets]
    for (k, v), group in zip(keys, groups, strict=True):
        out[k][v].append(group[0])
    return out


def greedy_answers(
    engine: RolloutEngine,
    versions: Sequence[str],
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[list[int]],
    rl: RLConfig,
) -> dict[str, list[Sample]]:
    """Greedy completions of every version on every prompt, in one engine call (``rl.rollout.max_new_tokens``)."""
    return greedy_sets(engine, [GreedySet(versions, prompts, prompt_ids, rl.rollout.max_new_tokens)], rl.seed)[0]


EVAL_CHUNK = 16  # sequences per forward pass at evaluation (bounds the [B, T, V] logits)


REFERENCE_CHUNK_ROWS = 64  # answers per reference forward: each prompt's answers together (bounds the [B, T, V] logits)


@torch.no_grad()
def reference_logprobs(
    base: ResidentBase, prompt_ids: Sequence[list[int]], answers: Mapping[str, Sequence[Sample]]
) -> dict[str, list[torch.Tensor | None]]:
    """Log-probs of every version's answers under the base with adapters disabled, in one pass.

    ``answers[v][i]`` is version ``v``'s answer to ``prompt_ids[i]``. Rows are
    ordered by prompt (prompt 0's answers from every version, then prompt 1's,
    ...) and a forward pass holds whole prompts' answers, up to
    ``REFERENCE_CHUNK_ROWS`` rows (more only when one prompt has more answers),
    so each prompt runs once for all versions (:mod:`trainer.model.logprobs`);
    answers without tokens are skipped, and an answer several versions gave
    alike to the same prompt (greedy answers often agree) is scored once, its
    log-probs shared by those versions.

    Returns:
        ``{version: [logprobs_T or None]}`` aligned with ``answers[version]``:
        a float32 CPU tensor of length ``T`` = the answer's token count
        (natural log), None for an answer without tokens.

    Raises:
        ValueError: a version's answers do not match ``prompt_ids`` in number.
    """
    for version, samples in answers.items():
        if len(samples) != len(prompt_ids):
            raise ValueError(f"version {version!r} has {len(samples)} answers for {len(prompt_ids)} prompts")
    out: dict[str, list[torch.Tensor | None]] = {v: [None] * len(prompt_ids) for v in answers}
    chunks: list[list[tuple[str, int]]] = [[]]
    scored_as: list[dict[str, str]] = []  # per prompt: version -> the version whose identical answer is scored
    for i in range(len(prompt_ids)):
        first: dict[tuple[int, ...], str] = {}
        for v in answers:
            if answers[v][i].token_ids:
                first.setdefault(tuple(answers[v][i].token_ids), v)
        scored_as.append({v: first[tuple(answers[v][i].token_ids)] for v in answers if answers[v][i].token_ids})
        rows = [(v, i) for v in first.values()]
        if chunks[-1] and len(chunks[-1]) + len(rows) > REFERENCE_CHUNK_ROWS:
            chunks.append([])
        chunks[-1].extend(rows)
    for chunk in chunks:
        if not chunk:
            continue
        with base.reference():
            logprobs_BT, _ = base.completion_logprobs(
                [prompt_ids[i] for _, i in chunk], [list(answers[v][i].token_ids) for v, i in chunk]
            )
        logprobs_BT = logprobs_BT.float().cpu()
        for b, (v, i) in enumerate(chunk):
            out[v][i] = logprobs_BT[b, : len(answers[v][i].token_ids)]
    for i, same in enumerate(scored_as):
        for v, scored in same.items():
            out[v][i] = out[scored][i]
    return out


def kl_to_base(samples: Sequence[Sample], reference: Sequence[torch.Tensor | None]) -> float:
    """Mean over sequences of the token-mean k3 KL(policy || base) on ``samples``.

    The policy side is each sample's own ``Sample.logprobs``: the log-probs of
    its tokens under the engine that served it (vLLM, or :class:`~trainer.rollout.hf.HFEngine`),
    so this is the KL of what is actually served. The base side is
    ``reference`` (from :func:`reference_logprobs`, aligned with ``samples``).
    A vLLM CPU engine computes in float32 and the trainer's base may be bf16:
    their difference is numeric noise (for an untrained adapter a mean KL of
    order 1e-4 or less). A sample without tokens has no KL term and is left
    out. Per-token KL: :func:`trainer.algorithms.losses.kl_k3` (Schulman 2020).

    Returns:
        The mean KL (nats); NaN when any value is NaN or no sample has tokens.

    Raises:
        RolloutError: a sample whose log-probs do not match its tokens in
            number (an engine that does not report them).
        ValueError: ``reference`` lacks log-probs of a sample's length.
    """
    kls: list[float] = []
    for s, ref_T in zip(samples, reference, strict=True):
        if not s.token_ids:
            continue
        if len(s.logprobs) != len(s.token_ids):
            raise RolloutError(
                f"answer {s.prompt_id!r} of {s.adapter_version!r} has {len(s.logprobs)} log-probs for "
                f"{len(s.token_ids)} tokens; the evaluation KL needs the engine's log-prob of every token"
            )
        if ref_T is None or ref_T.shape != (len(s.token_ids),):
            shape = None if ref_T is None else tuple(ref_T.shape)
            raise ValueError(
                f"reference log-probs of {s.prompt_id!r} ({s.adapter_version!r}) have shape {shape}, "
                f"expected ({len(s.token_ids)},)"
            )
        kls.append(float(kl_k3(torch.tensor(s.logprobs, dtype=torch.float32), ref_T.float()).mean()))
    return float(np.mean(kls)) if kls else float("nan")


@torch.no_grad()
def sequence_logps(
    base: ResidentBase, prompt_ids: Sequence[list[int]], completion_ids: Sequence[list[int]], *, reference: bool = False
) -> list[float]:
    """log pi(y|x) of each completion (sum over its tokens) under the live adapter, or the base with
    adapters disabled when ``reference``; ``EVAL_CHUNK`` sequences per forward pass."""
    out: list[float] = []
    for i in range(0, len(completion_ids), EVAL_CHUNK):
        ids, comps = prompt_ids[i : i + EVAL_CHUNK], completion_ids[i : i + EVAL_CHUNK]
        with base.reference() if reference else contextlib.nullcontext():
            logprobs_BT, mask_BT = base.completion_logprobs(ids, comps)
        out.extend(sequence_logprobs(logprobs_BT, mask_BT).tolist())
    return out


def score(samples: Sequence[Sample], prompts: Sequence[Prompt], mix: RewardMix) -> tuple[float, ...]:
    """Reward of each sample under ``mix`` (NaN kept, for the guardrail)."""
    return tuple(float(mix(p.messages, s.text, p.metadata)) for p, s in zip(prompts, samples))
