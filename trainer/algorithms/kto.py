"""KTO on logged rows (Ethayarajh et al. 2024): the logged completion is desirable when its reward mix is > 0
(a user correction is one more desirable example), and the loss is taken against the candidate's reference
policy (the base with adapters disabled, or with ``reference = "start"`` the adapter at the round's start), its
reference point from the batch's completions shifted by one (as TRL).

The two classes' loss weights are the candidate's ``kto_desirable_weight`` / ``kto_undesirable_weight``, or,
with ``kto_balance``, set once per round from its rows (:func:`balanced`): the KTO paper keeps
``weight x count`` of desirable to undesirable examples between 1 and 4/3, and fixed weights drift from any
ratio as the share of desirable rows moves (a better champion, corrections, sparse ratings). With noisy
labels the ratio also decides a direction: a wrong answer like those users went on from anyway is pushed up
as a desirable example and down as an undesirable one, and it goes down on balance only while the ratio is
below (share of wrong answers among the undesirable examples) / (share among the desirable ones), about 1.3
in the demo's traffic at a 5 % rating rate (98 % / 74 %), where fixed weights of 8 : 1 gave 2.7.

``kto_desirable_from = "explicit"`` removes that noise at its source: a logged answer that implicit signals alone
labelled positive (``continued``) is no example, so the desirable class holds only what users rated up or wrote
themselves (corrections); negative implicit labels (``rephrased``, ``regenerated``), which are clean, stay
undesirable examples."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from trainer.algorithms.batch import Batch, LossInputs, answer_ids, fit_after, logged_ids, logged_text
from trainer.algorithms.losses import kto_loss, sequence_logprobs
from trainer.algorithms.offline_is import logged_with_reward
from trainer.config import CandidateConfig
from trainer.errors import DataError
from trainer.model.base import ResidentBase
from trainer.algorithms.chunks import chunked_logprobs, row_chunks
from trainer.rewards import RewardMix
from trainer.types import Prompt, correction_text, implicit_label


@dataclass(frozen=True)
class _Example:
    """One KTO example of a logged row: its label, and the reward mix's value (None: the user's correction)."""

    desirable: bool
    value: float | None


def _implicit_only(p: Prompt, candidate: CandidateConfig) -> bool:
    """Whether ``kto_desirable_from = "explicit"`` holds the row's label as implicit: its ``reward_source`` names
    no reward the user gave (a row with no source, from before implicit signals, counts as explicit)."""
    return candidate.kto_desirable_from == "explicit" and implicit_label(p)


def _logged_example(p: Prompt, candidate: CandidateConfig) -> bool:
    """Whether the row's logged completion is a KTO example: it has a finite reward, and it is not a positive
    label from implicit signals alone (:func:`_implicit_only`)."""
    if not logged_with_reward(p, candidate):
        return False
    return not (_implicit_only(p, candidate) and (p.logged_reward or 0.0) > 0)


def _examples(candidate: CandidateConfig, p: Prompt, reward: RewardMix) -> Iterator[_Example]:
    """The row's KTO examples: the logged completion (desirable when the reward mix is > 0; see
    :func:`_logged_example` for when it is none) and, with ``candidate.kto_use_corrections``, the user's
    correction (desirable).

    Raises:
        DataError: the row has neither a logged completion that is an example nor a usable correction.
    """
    used = False
    if _logged_example(p, candidate):
        value = reward(p.messages, logged_text(p), {**p.metadata, "reward": p.logged_reward})
        used = True
        # an implicit label is never desirable under "explicit", whatever else the reward mix adds
        yield _Example(value > 0 and not _implicit_only(p, candidate), value)
    if candidate.kto_use_corrections and correction_text(p) is not None:
        used = True
        yield _Example(True, None)
    if not used:
        raise DataError(
            f"kto row {p.prompt_id!r} has no logged completion that is an example and no correction: filter it out first"
        )


def balanced(candidate: CandidateConfig, rows: Sequence[Prompt], reward: RewardMix) -> CandidateConfig:
    """``candidate`` with, under ``kto_balance``, the class weights for this round's ``rows``: ``weight x count``
    of desirable to undesirable examples is ``kto_desirable_weight : kto_undesirable_weight``, and the weights
    average 1 over the examples (the loss's scale is the fixed weights'). A class with no example keeps weight 1.
    Without ``kto_balance``, ``candidate`` as it is."""
    if not candidate.kto_balance:
        return candidate
    labels = [e.desirable for p in rows for e in _examples(candidate, p, reward)]
    n_desirable, n_undesirable = sum(labels), len(labels) - sum(labels)
    if not n_desirable or not n_undesirable:
        return candidate.model_copy(update={"kto_desirable_weight": 1.0, "kto_undesirable_weight": 1.0})
    # each class's share of the total weight, from the configured weights scaled to at most 1 first (no overflow
    # of their sum, and the smaller share computed directly, not as 1 minus the larger)
    scale = max(candidate.kto_desirable_weight, candidate.kto_undesirable_weight)
    desirable, undesirable = candidate.kto_desirable_weight / scale, candidate.kto_undesirable_weight / scale
    return candidate.model_copy(
        update={
            "kto_desirable_weight": len(labels) * desirable / (desirable + undesirable) / n_desirable,
            "kto_undesirable_weight": len(labels) * undesirable / (desirable + undesirable) / n_undesirable,
        }
    )


def kto_batch(
    candidate: CandidateConfig,
    prompts: Sequence[Prompt],
    prompt_ids: Sequence[list[int]],
    base: ResidentBase,
    reward: RewardMix,
) -> tuple[Batch, dict[str, float]]:
    """Logged rows as KTO examples: the logged completion, desirable when the reward mix
    (e.g. ``logged``: the buffer's reward from the user's feedback) is > 0; and, with
    ``candidate.kto_use_corrections``, the user's correction as one more desirable example.

    Raises:
        DataError: a row has neither a logged completion with a reward nor a usable correction.
    """
    ids: list[list[int]] = []
    completions: list[list[int]] = []
    desirable: list[bool] = []
    rewards: list[float] = []
    versions: list[str] = []
    corrections = 0
    for p, pids in zip(prompts, prompt_ids):
        for example in _examples(candidate, p, reward):
            ids.append(list(pids))
            desirable.append(example.desirable)
            if example.value is None:  # the user's correction
                completions.append(fit_after(base, pids, answer_ids(base, p, correction_text(p) or "")))
                versions.append("correction")
                corrections += 1
            else:
                completions.append(fit_after(base, pids, logged_ids(base, p)))
                rewards.append(example.value)
                versions.append(p.logged_adapter_version or "base")
    rewards_t = torch.tensor(rewards or [float("nan")], dtype=torch.float64)
    batch = Batch(
        prompt_ids=ids,
        completion_ids=completions,
        behaviour_logprobs=[[] for _ in ids],
        advantages=[1.0 if d else -1.0 for d in desirable],
        rewards=rewards,
        versions=versions,
        desirable=desirable,
    )
    metrics = {
        "train/reward_mean": rewards_t.mean().item(),
        "train/kto_desirable_frac": sum(desirable) / len(desirable),
        "train/kto_corrections": float(corrections),
    }
    return batch, metrics


def kto_policy_loss(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """KTO on the batch; the KL reference point uses the batch's completions shifted by one (as TRL), their
    log-probs taken without grad in chunks of ``rl.update.chunk_tokens`` padded tokens."""
    batch = x.batch
    shifted = [batch.completion_ids[-1], *batch.completion_ids[:-1]]
    chunks = row_chunks(batch.prompt_ids, shifted, x.rl.update.chunk_tokens, x.base.share_prompts)
    kl_BT, kl_mask_BT = chunked_logprobs(x.base, batch.prompt_ids, shifted, chunks)  # no grad
    with x.reference_policy():
        ref_kl_BT, _ = chunked_logprobs(x.base, batch.prompt_ids, shifted, chunks)
    desirable_B = torch.tensor(batch.desirable or [], dtype=torch.bool, device=x.base.device)
    policy_B = sequence_logprobs(x.logprobs_BT, x.mask_BT)
    reference_B = sequence_logprobs(x.ref_BT, x.mask_BT)
    loss, z0 = kto_loss(
        policy_B,
        reference_B,
        desirable_B,
        sequence_logprobs(kl_BT, kl_mask_BT),
        sequence_logprobs(ref_kl_BT, kl_mask_BT),
        beta=x.candidate.kto_beta,
        desirable_weight=x.candidate.kto_desirable_weight,
        undesirable_weight=x.candidate.kto_undesirable_weight,
    )
    margin_B = (policy_B - reference_B).detach()
    metrics = {
        "train/kto_z0": z0.item(),
        "train/kto_desirable_weight": x.candidate.kto_desirable_weight,
        "train/kto_undesirable_weight": x.candidate.kto_undesirable_weight,
    }
    if desirable_B.any():
        metrics["train/kto_logratio_desirable"] = margin_B[desirable_B].mean().item()
    if (~desirable_B).any():
        metrics["train/kto_logratio_undesirable"] = margin_B[~desirable_B].mean().item()
    return loss, metrics


def kto_row(p: Prompt, candidate: CandidateConfig) -> bool:
    """A row KTO can use: a logged completion that is an example (:func:`_logged_example`), or (with
    ``kto_use_corrections``) a correction."""
    return _logged_example(p, candidate) or bool(candidate.kto_use_corrections and correction_text(p) is not None)
