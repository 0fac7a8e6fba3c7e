"""A reward model learned from users' feedback, as an adapter on the resident base.

The reward model is a LoRA adapter in the round's adapter store (created,
activated, saved like any candidate) plus a scalar head
``nn.Linear(hidden, 1)`` in fp32 on the hidden state of the last real token
(after the final norm). It runs through the same resident base the policy
candidates use, so no second copy of the base is held in memory.

Loss on one step (labelled rows ``B``, preference pairs ``P``)::

    bce  = mean_B BCEWithLogits(r_b, label_b)                     # unpaired thumbs up / down
    bt   = mean_P -log σ(r_chosen - r_rejected)                   # Bradley & Terry 1952; Ouyang et al. 2022 (InstructGPT)
    loss = bce + bt + center_rewards_coefficient * mean_P (r_chosen + r_rejected)^2

The pair term and its optional centering term are TRL's ``RewardTrainer``
loss (``trl.RewardTrainer.compute_loss``: ``-logsigmoid(rewards_chosen -
rewards_rejected).mean()`` plus ``center_rewards_coefficient *
mean((rewards_chosen + rewards_rejected) ** 2)``, Eisenstein et al. 2023);
the pointwise term uses the same score as a logit of P(thumbs up).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import safetensors.torch
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from trainer.model.base import ResidentBase, attention_window
from trainer.model.logprobs import MIN_PREFIX_TOKENS_SAVED, distinct_prompts, worth_sharing
from trainer.config import RewardModelConfig
from trainer.errors import TrainerConfigError
from trainer.data import FeedbackData
from trainer.types import PhaseBoundary, PhaseHook, RewardModelReport, RoundPhase

if TYPE_CHECKING:
    from trainer.adapters.store import AdapterStore

HEAD_FILE = "reward_head.safetensors"

__all__ = [
    "HEAD_FILE",
    "RewardModel",
    "RewardModelReport",
    "TokenisedFeedback",
    "create_reward_model",
    "evaluate_reward_model",
    "reward_loss",
    "roc_auc",
    "tokenise_feedback",
    "train_reward_model",
]


def reward_loss(
    scores_B: torch.Tensor,
    labels_B: torch.Tensor,
    chosen_P: torch.Tensor,
    rejected_P: torch.Tensor,
    center_rewards_coefficient: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Pointwise BCE + Bradley-Terry pair loss (+ TRL's centering term), see the module docstring.

    Args:
        scores_B: scores (logits) of the labelled rows; labels_B: 1.0 thumbs up, 0.0 down. May be empty.
        chosen_P, rejected_P: scores of the preferred and the other completion of each pair. May be empty.

    Returns:
        ``(loss, metrics)``: the scalar loss and ``reward_model/bce``, ``reward_model/bt`` (0.0 for an empty part).
    """
    zero = scores_B.new_zeros(()) if scores_B.numel() else chosen_P.new_zeros(())
    bce = F.binary_cross_entropy_with_logits(scores_B, labels_B.to(scores_B.dtype)) if scores_B.numel() else zero
    if chosen_P.numel():
        bt = -F.logsigmoid(chosen_P - rejected_P).mean()
        center = torch.mean((chosen_P + rejected_P) ** 2) if center_rewards_coefficient else zero
    else:
        bt = center = zero
    loss = bce + bt + center_rewards_coefficient * center
    return loss, {"reward_model/bce": float(bce.detach()), "reward_model/bt": float(bt.detach())}


@dataclass(frozen=True)
class TokenisedFeedback:
    """Feedback as token ids. ``examples``: (prompt ids, completion ids, label); ``pairs``: (prompt, chosen, rejected)."""

    examples: tuple[tuple[list[int], list[int], bool], ...]
    pairs: tuple[tuple[list[int], list[int], list[int]], ...]
    sources: tuple[str, ...] = ()  # per example, the signals its label came from (LabelledExample.source)


def tokenise_feedback(base: ResidentBase, data: FeedbackData) -> TokenisedFeedback:
    """Prompt ids (the logged ids as served, else the chat template with the tools offered) and completion ids
    (the logged ids, else a tool-call answer rendered by the template, else the tokenised text) of every row."""
    examples = tuple(
        (
            base.prompt_ids(e.messages, e.tools, e.prompt_token_ids),
            base.completion_ids(
                e.completion, e.completion_token_ids, messages=e.messages, tool_calls=e.tool_calls, tools=e.tools
            ),
            e.label,
        )
        for e in data.examples
    )
    pairs = tuple(
        (
            base.prompt_ids(p.messages, p.tools, p.prompt_token_ids),
            base.completion_ids(
                p.chosen, p.chosen_token_ids, messages=p.messages, tool_calls=p.chosen_tool_calls, tools=p.tools
            ),
            base.completion_ids(
                p.rejected, p.rejected_token_ids, messages=p.messages, tool_calls=p.rejected_tool_calls, tools=p.tools
            ),
        )
        for p in data.pairs
    )
    return TokenisedFeedback(examples, pairs, tuple(e.source for e in data.examples))


class RewardModel:
    """A reward adapter in an adapter store plus its scalar head (fp32, on the base's device).

    Scoring and training need the adapter live: :meth:`score` activates it itself.
    """

    def __init__(
        self, name: str, base: ResidentBase, store: AdapterStore, head: torch.nn.Linear, batch_size: int = 16
    ) -> None:
        self.name = name
        self.base = base
        self.store = store
        self.head = head
        self.batch_size = batch_size
        self.head_optimizer: torch.optim.Optimizer | None = None

    def _strip(self, ids: Sequence[int]) -> list[int]:
        """Completion ids without trailing EOS / pad (logged ids carry them, tokenised text does not)."""
        out, ends = list(ids), {self.base.tokenizer.eos_token_id, self.base.tokenizer.pad_token_id}
        while out and out[-1] in ends:
            out.pop()
        return out

    def forward(self, prompt_ids_B: Sequence[Sequence[int]], completion_ids_B: Sequence[Sequence[int]]) -> torch.Tensor:
        """Scores ``[B]`` (fp32, with grad): the head on the final-norm hidden state of each sequence's last token.

        Prompts are cut from the left to fit ``max_seq_len``. What rows share runs once when that saves enough
        tokens (:func:`last_hidden_states`): the tokens every row opens with (the chat template's system turn,
        an app's system prompt) and each distinct prompt (a preference pair's two answers; users asking the
        same question); gradients flow as in one plain forward. The adapter must be live.
        """
        base = self.base
        pad = base.tokenizer.pad_token_id if base.tokenizer.pad_token_id is not None else 0
        prompts, completions = [], []
        for p, c in zip(prompt_ids_B, completion_ids_B):
            c = self._strip(c)[-base.max_seq_len :]
            keep = base.max_seq_len - len(c)  # the prompt's tokens that still fit, from its end
            prompts.append(list(p)[max(0, len(p) - keep) :] if keep else [])
            completions.append(c)
        lm = _causal_lm(base)  # LoRA layers are injected in place: the backbone runs the live adapter
        backbone = getattr(lm, lm.base_model_prefix)
        with base.attention_for(max(len(p) + len(c) for p, c in zip(prompts, completions))):
            hidden_BH = last_hidden_states(backbone, prompts, completions, pad, base.device, attention_window(lm))
        return self.head(hidden_BH.float()).squeeze(-1)

    def chunks(
        self, prompt_ids_B: Sequence[Sequence[int]], completion_ids_B: Sequence[Sequence[int]], max_tokens: int
    ) -> list[tuple[int, int]]:
        """Consecutive row ranges ``(start, end)`` whose padded size (rows x the longest row, as :meth:`forward`
        pads them) stays within ``max_tokens``; a row longer than that is a chunk alone."""
        out: list[tuple[int, int]] = []
        start, longest = 0, 0
        for b, (p, c) in enumerate(zip(prompt_ids_B, completion_ids_B)):
            length = max(1, min(len(p) + len(self._strip(c)), self.base.max_seq_len))
            if b > start and (b - start + 1) * max(longest, length) > max_tokens:
                out.append((start, b))
                start, longest = b, 0
            longest = max(longest, length)
        out.append((start, len(prompt_ids_B)))
        return out

    @torch.no_grad()
    def score(self, prompt_ids_B: Sequence[Sequence[int]], completion_ids_B: Sequence[Sequence[int]]) -> list[float]:
        """Scalar reward (a logit of P(thumbs up)) per (prompt, completion); batched, no grad.

        Each distinct sequence is scored once (held-out feedback repeats them: a preference pair's chosen and
        rejected answers are mostly rows of their own, and users get the same answer to the same question;
        the demo's last window scored 1,146 rows holding 357 distinct ones), in batches of similar length so
        little of a batch is padding, a prompt's rows side by side so that it runs once for them. Activates this
        reward model's adapter in the store; the caller re-activates whatever it needs next.
        """
        if not prompt_ids_B:
            return []
        slot: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}  # distinct sequence -> its index in `unique`
        where = [
            slot.setdefault((tuple(p), tuple(self._strip(c))), len(slot))
            for p, c in zip(prompt_ids_B, completion_ids_B)
        ]
        unique = list(slot)
        longest: dict[tuple[int, ...], int] = {}  # per prompt, its longest row
        for p, c in unique:
            longest[p] = max(longest.get(p, 0), len(p) + len(c))
        # batches of similar length, a prompt's rows side by side (its prompt then runs once for them)
        order = sorted(range(len(unique)), key=lambda u: (longest[unique[u][0]], unique[u][0], len(unique[u][1])))
        scores = [0.0] * len(unique)
        self.store.activate(self.name)
        was_training = self.base.model.training
        self.base.model.eval()
        try:
            for i in range(0, len(order), self.batch_size):
                batch = order[i : i + self.batch_size]
                got = self.forward([unique[u][0] for u in batch], [unique[u][1] for u in batch]).tolist()
                for u, value in zip(batch, got):
                    scores[u] = value
            return [scores[u] for u in where]
        finally:
            self.base.model.train(was_training)

    def save(self, out_dir: Path) -> Path:
        """The PEFT folder of the adapter plus ``reward_head.safetensors`` (``weight [1, H]``, ``bias [1]``)."""
        folder = self.store.save(self.name, Path(out_dir))
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.head.state_dict().items()}
        safetensors.torch.save_file(tensors, str(Path(folder) / HEAD_FILE))
        return Path(folder)


def _causal_lm(base: ResidentBase) -> Any:
    """The transformers model inside the PEFT wrapper (PEFT types it as a plain ``nn.Module``)."""
    return base.model.get_base_model()


def _hidden_size(base: ResidentBase) -> int:
    """The width of the backbone's hidden state: the text model's (a multimodal config nests it in text_config)."""
    return int(_causal_lm(base).config.get_text_config().hidden_size)


def last_hidden_states(
    backbone: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad: int,
    device: torch.device,
    window: int | None = None,
) -> torch.Tensor:
    """The backbone's final-norm hidden state at the last token of each row (prompt + completion), ``[B, H]``.

    Whatever the rows share runs once, in the pass that runs the fewest padded tokens when the difference is
    worth a forward of its own (:data:`trainer.model.logprobs.MIN_PREFIX_TOKENS_SAVED`):

    - **plain**: the rows left-padded to ``[B, L]``, one forward (column ``L-1`` is every row's last token);
    - **prefix**: the tokens every row opens with (:func:`trainer.model.logprobs.worth_sharing`) as one row
      ``[1, S]`` with its keys and values cached, the cache rows gathered to ``[B, ...]``
      (:meth:`transformers.DynamicCache.batch_select_indices`, which autograd follows, so the prefix's gradient
      is the sum of its rows'), then every row's rest right-padded ``[B, R]`` after it;
    - **prompts**: that prefix once, then each distinct prompt's rest once, left-padded ``[U, P]`` (a
      preference pair's two answers share their prompt; users ask the same question), the cache gathered to
      the rows, then every row's completion right-padded ``[B, T]``. Every row needs a prompt token and a
      completion token. A model with sliding-window layers skips the prefix when the longest prompt plus the
      longest completion reaches its ``window``: the left pads between a short prompt's prefix and its rest put
      its answer as far from the prefix, in cache slots, as if its prompt were the longest.

    Each is the same causal attention over the same tokens at the same positions (equal up to float rounding;
    tested on scores and gradients). The demo's rows are 43-token prompts that open with the template's 26-token
    system turn, and answers of 1 to 16 tokens; a training step's 24 rows hold about 15 distinct prompts. 16
    training steps on one of its windows took 84.7 s plain and 58.8 s with the prefix (a later run: 62.1 s with
    the prefix, 58.5 s with each prompt once; a held-out evaluation 16.1 s and 12.9 s).
    """
    B = len(prompts)
    seqs = [list(p) + list(c) or [pad] for p, c in zip(prompts, completions)]
    shared = worth_sharing(seqs)
    longest = max(len(s) for s in seqs)
    by_prefix = shared + B * (longest - shared)  # padded tokens of the plain or the prefix pass
    if all(prompts) and all(completions):
        owner_B, first_U = distinct_prompts(prompts)
        distinct = [prompts[b] for b in first_U]
        # a short prompt's left pads sit between the opening and its rest: its answer is as far from the opening as
        # if its prompt were the longest, so the farthest cache distance is the longest prompt plus the longest answer
        reach = max(map(len, prompts)) + max(map(len, completions))
        prefix = worth_sharing(distinct) if window is None or reach < window else 0
        by_prompt = prefix + len(distinct) * (max(map(len, distinct)) - prefix) + B * max(map(len, completions))
        if by_prefix - by_prompt >= MIN_PREFIX_TOKENS_SAVED:
            return _by_prompt(backbone, distinct, completions, owner_B, prefix, pad, device)
    if shared == 0:
        input_BL = torch.full((B, longest), pad, dtype=torch.long)
        attn_BL = torch.zeros((B, longest), dtype=torch.long)
        for b, seq in enumerate(seqs):
            input_BL[b, longest - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            attn_BL[b, longest - len(seq) :] = 1
        out = backbone(
            input_ids=input_BL.to(device),
            attention_mask=attn_BL.to(device),
            position_ids=(attn_BL.cumsum(1) - 1).clamp(min=0).to(device),
            use_cache=False,
        )
        return out.last_hidden_state[:, -1]
    cache = _prefix_cache(backbone, seqs[0][:shared], B, device)
    rest = [s[shared:] for s in seqs]
    input_BR, attn_BR = _right_padded(rest, pad)
    R = input_BR.shape[1]
    out = backbone(
        input_ids=input_BR.to(device),
        attention_mask=torch.cat([torch.ones((B, shared), dtype=torch.long), attn_BR], dim=1).to(device),
        position_ids=(shared + torch.arange(R)).unsqueeze(0).expand(B, R).to(device),
        past_key_values=cache,
        use_cache=True,
    )
    return out.last_hidden_state[
        torch.arange(B, device=device), torch.tensor([len(r) - 1 for r in rest], device=device)
    ]


def _prefix_cache(backbone: Any, prefix: Sequence[int], rows: int, device: torch.device) -> DynamicCache:
    """The keys and values of ``prefix`` run once as one row, gathered to ``rows`` rows."""
    cache = DynamicCache()
    S = len(prefix)
    backbone(
        input_ids=torch.tensor([list(prefix)], dtype=torch.long, device=device),
        position_ids=torch.arange(S, device=device).unsqueeze(0),
        past_key_values=cache,
        use_cache=True,
    )
    cache.batch_select_indices(torch.zeros(rows, dtype=torch.long, device=device))
    return cache


def _right_padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of ``rows`` right-padded to the longest, ``[B, T]``."""
    T = max(len(r) for r in rows)
    ids, mask = torch.full((len(rows), T), pad, dtype=torch.long), torch.zeros((len(rows), T), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[b, : len(r)] = 1
    return ids, mask


def _by_prompt(
    backbone: Any,
    distinct: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    owner_B: Sequence[int],
    prefix: int,
    pad: int,
    device: torch.device,
) -> torch.Tensor:
    """:func:`last_hidden_states`' prompts pass: the ``prefix`` once, each distinct prompt's rest once, then every
    row's completion after its prompt's cached keys and values."""
    U, B, S = len(distinct), len(completions), prefix
    lens_p = [len(p) for p in distinct]
    P = max(lens_p) - S
    prompt_UP = torch.full((U, P), pad, dtype=torch.long)
    mask_UL = torch.cat([torch.ones((U, S), dtype=torch.long), torch.zeros((U, P), dtype=torch.long)], dim=1)
    for u, p in enumerate(distinct):
        prompt_UP[u, P - (len(p) - S) :] = torch.tensor(list(p[S:]), dtype=torch.long)
        mask_UL[u, S + P - (len(p) - S) :] = 1
    cache = _prefix_cache(backbone, distinct[0][:S], U, device) if S else DynamicCache()
    backbone(
        input_ids=prompt_UP.to(device),
        attention_mask=mask_UL.to(device),
        position_ids=(mask_UL.cumsum(1) - 1).clamp(min=0)[:, S:].to(device),
        past_key_values=cache,
        use_cache=True,
    )
    owner = torch.tensor(list(owner_B), dtype=torch.long)
    cache.batch_select_indices(owner.to(device))
    input_BT, mask_BT = _right_padded(completions, pad)
    T = input_BT.shape[1]
    out = backbone(
        input_ids=input_BT.to(device),
        attention_mask=torch.cat([mask_UL[owner], mask_BT], dim=1).to(device),
        position_ids=(torch.tensor(lens_p)[owner].unsqueeze(1) + torch.arange(T).unsqueeze(0)).to(device),
        past_key_values=cache,
        use_cache=True,
    )
    last_B = torch.tensor([len(c) - 1 for c in completions], dtype=torch.long, device=device)
    return out.last_hidden_state[torch.arange(B, device=device), last_B]


def create_reward_model(
    base: ResidentBase,
    store: AdapterStore,
    cfg: RewardModelConfig,
    init_dir: Path | None,
    seed: int = 0,
    *,
    name: str | None = None,
) -> RewardModel:
    """Create the reward adapter in ``store`` (from ``init_dir`` or fresh) and its head.

    The head is loaded from ``init_dir / reward_head.safetensors`` when there is one,
    else initialised ``N(0, 1/H)`` (seeded), bias 0.

    Raises:
        TrainerConfigError: the saved head does not match the base's hidden size, or
            the saved adapter does not fit (from the store).
    """
    name = name or cfg.name
    store.create(name, cfg.as_candidate(), init_dir)
    hidden = _hidden_size(base)
    head = torch.nn.Linear(hidden, 1, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7)
        torch.nn.init.normal_(head.weight, std=hidden**-0.5)
        torch.nn.init.zeros_(head.bias)
    head_file = Path(init_dir) / HEAD_FILE if init_dir is not None else None
    if head_file is not None and head_file.is_file():
        saved = safetensors.torch.load_file(str(head_file))
        if tuple(saved.get("weight", torch.empty(0)).shape) != (1, hidden):
            store.delete(name)
            raise TrainerConfigError(
                f"reward head {head_file} has weight {tuple(saved.get('weight', torch.empty(0)).shape)}, the base needs (1, {hidden}); "
                "it was trained on another base: use [reward_model] start = 'fresh'"
            )
        head.load_state_dict(saved)
    head.to(base.device)
    model = RewardModel(name, base, store, head, max(16, cfg.batch_size))  # no-grad scoring takes larger batches
    model.head_optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    return model


def train_reward_model(
    model: RewardModel,
    data: TokenisedFeedback,
    cfg: RewardModelConfig,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    on_phase: PhaseHook | None = None,
) -> list[dict[str, float]]:
    """``cfg.steps`` AdamW steps of adapter + head on :func:`reward_loss`.

    Each step draws ``cfg.batch_size`` labelled rows and, when there are pairs,
    ``cfg.batch_size`` pairs (without replacement within an epoch, seeded), and
    scores them all in one forward pass, or, above ``cfg.chunk_tokens`` padded tokens, in chunks with the
    same gradient (:meth:`RewardModel.chunks`). ``on_phase`` is called with
    ``PhaseBoundary(RoundPhase.REWARD_MODEL, step=k)`` before every step (it may raise to stop the round).

    Returns one metrics dict per step: ``reward_model/loss``, ``/bce``, ``/bt``,
    ``/grad_norm``, ``/train_accuracy`` (labelled rows of the batch), ``/step_s``.
    """
    rng = random.Random(seed * 7919 + 1)
    decks: dict[str, list[int]] = {"examples": [], "pairs": []}

    def draw(kind: str, n: int, k: int) -> list[int]:
        out: list[int] = []
        while n and len(out) < k:
            if not decks[kind]:
                decks[kind] = rng.sample(range(n), n)
            out.append(decks[kind].pop())
        return out

    history = []
    for step in range(cfg.steps):
        if on_phase is not None:
            on_phase(PhaseBoundary(RoundPhase.REWARD_MODEL, step=step))
        started = time.perf_counter()
        optimizer = model.store.activate(model.name)
        model.base.model.eval()  # no dropout: chunked steps score and backpropagate the same deterministic passes
        ex = [data.examples[i] for i in draw("examples", len(data.examples), cfg.batch_size)]
        pr = [data.pairs[i] for i in draw("pairs", len(data.pairs), cfg.batch_size)]
        prompts = [e[0] for e in ex] + [p[0] for p in pr] * 2
        completions = [e[1] for e in ex] + [p[1] for p in pr] + [p[2] for p in pr]
        chunks = model.chunks(prompts, completions, cfg.chunk_tokens)
        optimizer.zero_grad(set_to_none=True)
        model.head_optimizer.zero_grad(set_to_none=True)  # type: ignore[union-attr]
        if len(chunks) == 1:  # one forward/backward (every step of short rows)
            scores = model.forward(prompts, completions)
        else:  # scores without grad, chunk by chunk; the loss's gradient of each score is pushed back per chunk
            with torch.no_grad():
                scores = torch.cat([model.forward(prompts[s:e], completions[s:e]) for s, e in chunks])
            scores.requires_grad_(True)
        scores_B, chosen_P, rejected_P = (
            scores[: len(ex)],
            scores[len(ex) : len(ex) + len(pr)],
            scores[len(ex) + len(pr) :],
        )
        labels_B = torch.tensor([float(e[2]) for e in ex], device=scores.device)
        loss, metrics = reward_loss(scores_B, labels_B, chosen_P, rejected_P, cfg.center_rewards_coefficient)
        loss.backward()
        if len(chunks) > 1:
            assert scores.grad is not None
            for s, e in chunks:
                model.forward(prompts[s:e], completions[s:e]).backward(scores.grad[s:e])
        params = [p for group in optimizer.param_groups for p in group["params"]] + list(model.head.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
        if np.isfinite(grad_norm):
            optimizer.step()
            model.head_optimizer.step()  # type: ignore[union-attr]
        optimizer.zero_grad(set_to_none=True)
        model.head_optimizer.zero_grad(set_to_none=True)  # type: ignore[union-attr]
        accuracy = float(((scores_B.detach() > 0).float() == labels_B).float().mean()) if ex else float("nan")
        history.append(
            {
                "reward_model/loss": float(loss.detach()),
                **metrics,
                "reward_model/grad_norm": grad_norm,
                "reward_model/train_accuracy": accuracy,
                "reward_model/step_s": time.perf_counter() - started,
            }
        )
    model.base.model.eval()
    return history


# --- held-out evaluation ------------------------------------------------------------------


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties averaged."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=ranks) / counts)[inverse]


def roc_auc(scores_N: npt.ArrayLike, labels_N: npt.ArrayLike) -> float:
    """ROC AUC = P(score of a random positive > a random negative), ties count half
    (Mann-Whitney U / (P N); Hanley & McNeil 1982). NaN without both labels, or when a score is NaN (it would
    rank above every number: a head that scores NaN on the up-voted rows would look perfect)."""
    scores, labels = np.asarray(scores_N, dtype=np.float64), np.asarray(labels_N, dtype=bool)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0 or np.isnan(scores).any():
        return float("nan")
    return float((_ranks(scores)[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def auc_by_signal(scores_N: Sequence[float], labels_N: Sequence[bool], sources_N: Sequence[str]) -> dict[str, float]:
    """Per feedback signal, how well the scores tell its verdicts apart: the ROC AUC over the rows that
    signal labelled (a source ``"thumbs+edited"`` counts for both), joined, where they carry one label only
    (``continued`` is always up, ``rephrased`` always down), by every row of the other label. So
    ``continued``'s AUC is P(a continued answer outscores a down-voted or rephrased one). Signals whose
    rows and their counterparts do not hold both labels are left out (the AUC is undefined)."""
    scores, labels = np.asarray(scores_N, dtype=np.float64), np.asarray(labels_N, dtype=bool)
    by_signal: dict[str, list[int]] = {}
    for i, source in enumerate(sources_N):
        for signal in filter(None, source.split("+")):
            by_signal.setdefault(signal, []).append(i)
    out = {}
    for signal, rows in sorted(by_signal.items()):
        mask = np.zeros(labels.size, dtype=bool)
        mask[rows] = True
        own = labels[mask]
        if own.all():  # one label only: against every row of the other label
            mask |= ~labels
        elif not own.any():
            mask |= labels
        value = roc_auc(scores[mask], labels[mask])
        if not np.isnan(value):
            out[signal] = value
    return out


def auc_lower_bound(
    scores_N: Sequence[float], labels_N: Sequence[bool], confidence: float, resamples: int, seed: int = 0
) -> float:
    """Lower ``confidence`` percentile bound of the AUC by the bootstrap over rows
    (Efron & Tibshirani 1993); resamples with one label only are skipped. NaN when none remain."""
    scores, labels = np.asarray(scores_N, dtype=np.float64), np.asarray(labels_N, dtype=bool)
    if scores.size == 0:
        return float("nan")
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        idx = rng.integers(0, scores.size, size=scores.size)
        value = roc_auc(scores[idx], labels[idx])
        if not np.isnan(value):
            values.append(value)
    return float(np.quantile(values, 1.0 - confidence)) if values else float("nan")


def expected_calibration_error(scores_N: Sequence[float], labels_N: Sequence[bool], bins: int = 10) -> float:
    """ECE of ``sigmoid(score)`` against the labels: sum over ``bins`` equal-width bins of
    (bin share) * |mean label - mean probability| (Guo et al. 2017). NaN without rows."""
    probs = 1.0 / (1.0 + np.exp(-np.asarray(scores_N, dtype=np.float64)))
    labels = np.asarray(labels_N, dtype=np.float64)
    if probs.size == 0:
        return float("nan")
    which = np.minimum((probs * bins).astype(int), bins - 1)
    ece = 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            ece += mask.mean() * abs(labels[mask].mean() - probs[mask].mean())
    return float(ece)


def evaluate_reward_model(
    model: RewardModel, data: TokenisedFeedback, confidence: float, resamples: int, seed: int = 0
) -> RewardModelReport:
    """AUC (+ bootstrap lower bound), accuracy (``score > 0`` vs label), ECE and pair accuracy on held-out feedback."""
    n, k = len(data.examples), len(data.pairs)
    every = model.score(  # one call: a sequence among the rows and the pairs is scored once
        [e[0] for e in data.examples] + [p[0] for p in data.pairs] * 2,
        [e[1] for e in data.examples] + [p[1] for p in data.pairs] + [p[2] for p in data.pairs],
    )
    scores, chosen, rejected = every[:n], every[n : n + k], every[n + k :]
    labels = [e[2] for e in data.examples]
    # a pair whose two answers are one sequence scores a tie: half right, as the AUC counts ties
    pair_accuracy = (
        float(np.mean([1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(chosen, rejected)])) if k else None
    )
    accuracy = float(np.mean([(s > 0) == y for s, y in zip(scores, labels)])) if scores else float("nan")
    return RewardModelReport(
        auc=roc_auc(scores, labels),
        auc_by_signal=auc_by_signal(scores, labels, data.sources) if len(data.sources) == len(labels) else {},
        auc_lower_bound=auc_lower_bound(scores, labels, confidence, resamples, seed),
        accuracy=accuracy,
        ece=expected_calibration_error(scores, labels),
        pair_accuracy=pair_accuracy,
        heldout_examples=len(labels),
        heldout_pairs=len(data.pairs),
    )
