"""Rollouts with transformers ``generate`` on the resident base (:class:`HFEngine`): for hosts without
vLLM and for small tests; one adapter at a time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from trainer.model.base import ResidentBase
from trainer.errors import RolloutError
from trainer.types import BASE_VERSION, RolloutRequest
from trainer.types import Sample

if TYPE_CHECKING:
    from trainer.adapters.store import AdapterStore


class HFEngine:
    """Rollouts with ``transformers`` ``generate`` on the resident base.

    ``load`` maps a version name to a candidate of the adapter store (the
    live weights in the store *are* the newest version, so ``adapter_dir`` is
    only recorded). Log-probs are of the raw logits (temperature 1), the
    distribution the trainer's loss uses.
    """

    def __init__(self, base: ResidentBase, store: AdapterStore, batch_size: int = 16) -> None:
        self.base = base
        self.store = store
        self.batch_size = batch_size
        self.versions: dict[str, str] = {}

    def load(self, candidate: str, version: str, adapter_dir: Path) -> None:
        if version in self.versions:
            raise RolloutError(f"version {version!r} is already loaded; publish updates under a new name")
        self.versions[version] = candidate

    def unload(self, version: str) -> None:
        if self.versions.pop(version, None) is None:
            raise RolloutError(f"version {version!r} is not loaded; loaded: {sorted(self.versions)}")

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[Sample]]:
        """``n`` samples per request, in request order.

        Requests of one version and the same sampling settings (``n``,
        temperature, max_new_tokens, seed) run as left-padded batches (about
        ``batch_size`` sequences).

        Raises:
            RolloutError: a version that was never loaded.
        """
        out: list[list[Sample] | None] = [None] * len(requests)
        batches: dict[tuple[str, int, int, float, int], list[int]] = {}
        for i, req in enumerate(requests):
            if req.version != BASE_VERSION and req.version not in self.versions:
                raise RolloutError(f"version {req.version!r} is not loaded; loaded: {sorted(self.versions)}")
            batches.setdefault((req.version, req.n, req.max_new_tokens, req.temperature, req.seed), []).append(i)
        for (version, *_settings), indices in batches.items():
            for start in range(0, len(indices), max(1, self.batch_size // max(1, requests[indices[0]].n))):
                chunk = indices[start : start + max(1, self.batch_size // max(1, requests[indices[0]].n))]
                samples = self._generate_chunk(version, [requests[i] for i in chunk])
                for i, group in zip(chunk, samples):
                    out[i] = group
        return [group or [] for group in out]

    @torch.no_grad()
    def _generate_chunk(self, version: str, requests: Sequence[RolloutRequest]) -> list[list[Sample]]:
        tok = self.base.tokenizer
        model = self.base.model
        pad = tok.pad_token_id
        rows = [(i, list(r.prompt_token_ids)) for i, r in enumerate(requests) for _ in range(r.n)]
        P = max(len(ids) for _, ids in rows)
        input_BP = torch.full((len(rows), P), pad, dtype=torch.long)
        attn_BP = torch.zeros_like(input_BP)
        for b, (_, ids) in enumerate(rows):  # left padding for generation
            input_BP[b, P - len(ids) :] = torch.tensor(ids)
            attn_BP[b, P - len(ids) :] = 1
        greedy = requests[0].temperature == 0
        kwargs = (
            {"do_sample": False}
            if greedy
            else {"do_sample": True, "temperature": requests[0].temperature, "top_k": 0, "top_p": 1.0}
        )
        torch.manual_seed(requests[0].seed)
        was_training = model.training
        model.eval()
        try:
            if version == BASE_VERSION:
                with self.base.reference():
                    gen = self._run(input_BP, attn_BP, requests[0].max_new_tokens, kwargs)
            else:
                self.store.activate(self.versions[version])
                gen = self._run(input_BP, attn_BP, requests[0].max_new_tokens, kwargs)
        finally:
            model.train(was_training)
        if gen.logits is None:
            raise RolloutError("generate returned no logits although output_logits=True was asked")
        new_BT = gen.sequences[:, P:]
        logits_BTV = torch.stack(gen.logits, dim=1).float()
        logprobs_BT = torch.log_softmax(logits_BTV, dim=-1).gather(-1, new_BT.unsqueeze(-1)).squeeze(-1)
        eos = set(tok.eos_token_id if isinstance(tok.eos_token_id, list) else [tok.eos_token_id])
        groups: dict[int, list[Sample]] = {}
        for b, (i, _) in enumerate(rows):
            req = requests[i]
            ids, lps, reason = [], [], "length"
            for t, token in enumerate(new_BT[b].tolist()):
                ids.append(token)
                lps.append(float(logprobs_BT[b, t]))
                if token in eos:
                    reason = "stop"
                    break
            text = tok.decode(ids, skip_special_tokens=True)
            assert isinstance(text, str), "one sequence of ids decodes to one string"
            groups.setdefault(i, []).append(
                Sample(
                    prompt_id=req.prompt_id,
                    text=text,
                    token_ids=tuple(ids),
                    logprobs=tuple(lps),
                    adapter_version=version,
                    finish_reason=reason,
                )
            )
        return [groups[i] for i in range(len(requests))]

    def _run(
        self, input_BP: torch.Tensor, attn_BP: torch.Tensor, max_new_tokens: int, kwargs: dict
    ) -> GenerateDecoderOnlyOutput:
        device = self.base.device
        return self.base.model.generate(
            input_ids=input_BP.to(device),
            attention_mask=attn_BP.to(device),
            max_new_tokens=max_new_tokens,
            pad_token_id=self.base.tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )
