"""Each distinct prompt run once (trainer.model.logprobs) gives the whole-row pass's log-probs and gradients (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.model.base import ResidentBase, load_base, lora_config
from trainer.config import CandidateConfig, ModelConfig
from trainer.model.logprobs import MIN_PREFIX_TOKENS_SAVED, common_prefix_length, distinct_prompts, worth_sharing

from .float32_tolerance import GRAD_TOL, LOGPROB_TOL, assert_gradients_close, max_relative_error

ADAPTER = "shared-prompts-test"


@pytest.fixture(scope="module")
def base(peaked_model: Path) -> ResidentBase:
    return _with_random_adapter(load_base(ModelConfig(name=str(peaked_model), dtype="float32", device="cpu")), 0)


def _with_random_adapter(base: ResidentBase, seed: int) -> ResidentBase:
    """``base`` with a live rank-4 adapter of seeded random weights (non-zero B: it changes the logits)."""
    base.model.add_adapter(ADAPTER, lora_config(CandidateConfig(name="a", lora_rank=4, lora_alpha=8)))
    base.model.set_adapter(ADAPTER)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in base.model.named_parameters():
            if f".{ADAPTER}." in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
                p.requires_grad_(True)
    return base


def _rows() -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts of different lengths, three rows each, interleaved; completions of 0..6 tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 400, (n,), generator=g).tolist() for n in (4, 9, 7)]
    lengths = [3, 0, 6, 1, 5, 2, 6, 4, 1]
    rows = [prompts[i % 3] for i in range(9)]
    completions = [torch.randint(10, 400, (n,), generator=g).tolist() for n in lengths]
    return rows, completions


def _pass(
    base: ResidentBase, share: bool, rows: tuple[list, list] | None = None, keys: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], list]:
    prompts, completions = rows or _rows()
    params = {n: p for n, p in base.model.named_parameters() if p.requires_grad}
    for p in params.values():
        p.grad = None
    shapes: list[tuple[int, ...]] = []
    embed = base.model.get_input_embeddings()
    handle = embed.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    base.share_prompts = share
    try:
        lp_BT, mask_BT = base.completion_logprobs(prompts, completions, keys_B=keys)
    finally:
        base.share_prompts = True
        handle.remove()
    (lp_BT * torch.linspace(0.5, 1.5, lp_BT.shape[1])).sum().backward()  # every column weighs differently
    return lp_BT.detach(), mask_BT, {n: p.grad.clone() for n, p in params.items()}, shapes


def test_shared_prompts_give_the_whole_rows_logprobs_and_gradients(base: ResidentBase) -> None:
    whole_lp, whole_mask, whole_grads, whole_shapes = _pass(base, share=False)
    lp, mask, grads, shapes = _pass(base, share=True)
    assert whole_shapes == [(9, 9 + 5)]  # one forward of every row whole (the longest: 9 + 5 tokens)
    assert shapes == [(3, 9), (9, 5)]  # the 3 distinct prompts once, then every row's completion but its last token
    assert torch.equal(mask, whole_mask)
    assert mask.sum(1).tolist() == [3, 0, 6, 1, 5, 2, 6, 4, 1]
    # the same attention over the same tokens and positions in another order of operations: float32 rounding
    lp_err = max_relative_error(lp, whole_lp)
    assert lp_err < LOGPROB_TOL, lp_err
    assert float(whole_lp.abs().max()) > 1.0  # real log-probs, not zeros
    assert grads
    worst = assert_gradients_close(grads, whole_grads, GRAD_TOL)
    print(
        f"shared vs whole: log-prob error / LOGPROB_TOL {lp_err / LOGPROB_TOL:.3g}, gradients / GRAD_TOL {worst[0]:.3g}"
    )


def test_no_repeated_prompt_runs_rows_whole(base: ResidentBase) -> None:
    shapes: list[tuple[int, ...]] = []
    handle = base.model.get_input_embeddings().register_forward_pre_hook(
        lambda m, args: shapes.append(tuple(args[0].shape))
    )
    try:
        with torch.no_grad():
            base.completion_logprobs([[11, 12], [11, 12, 13]], [[5], [6, 7]])
            base.completion_logprobs([[11, 12], [11, 12]], [[5], [6, 7]], keys_B=[0, 1])  # other keys: no sharing
    finally:
        handle.remove()
    assert shapes == [(2, 5), (2, 4)]


def test_distinct_prompts_share_only_within_a_key() -> None:
    prompts = [[1, 2], [1, 2], [3], [1, 2], [3]]
    assert distinct_prompts(prompts) == ([0, 0, 1, 0, 1], [0, 2])
    assert distinct_prompts(prompts, keys_B=[0, 0, 0, 1, 1]) == ([0, 0, 1, 2, 3], [0, 2, 3, 4])
    assert distinct_prompts([]) == ([], [])


@pytest.mark.parametrize("share", [True, False], ids=["shared-prompts", "whole-rows"])
def test_short_cpu_passes_run_eager_attention_with_sdpas_results(
    base: ResidentBase, share: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short pass on CPU runs eager attention (its backward is faster there, trainer.model.base) and gives
    SDPA's log-probs and gradients; a pass longer than the bound runs SDPA; the model is left as loaded."""
    import trainer.model.base as base_module

    seen: list[str] = []
    attention = base.model.get_base_model().model.layers[0].self_attn
    handle = attention.register_forward_pre_hook(lambda m, args: seen.append(m.config._attn_implementation))
    try:
        assert base.model.config._attn_implementation == "sdpa"
        eager_lp, _, eager_grads, _ = _pass(base, share)
        assert seen and set(seen) == {"eager"}
        monkeypatch.setattr(base_module, "EAGER_ATTENTION_MAX_TOKENS", 14)  # the longest row has 9 + 5 tokens
        assert _pass(base, share)[0].equal(eager_lp)
        monkeypatch.setattr(base_module, "EAGER_ATTENTION_MAX_TOKENS", 13)
        seen.clear()
        sdpa_lp, _, sdpa_grads, _ = _pass(base, share)
        assert seen and set(seen) == {"sdpa"}
    finally:
        handle.remove()
    assert base.model.config._attn_implementation == "sdpa"
    lp_err = max_relative_error(eager_lp, sdpa_lp)
    assert lp_err < LOGPROB_TOL, lp_err
    assert_gradients_close(eager_grads, sdpa_grads, GRAD_TOL)


def test_common_prefix_length_leaves_every_row_a_token_of_its_own() -> None:
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7]]) == 2
    assert common_prefix_length([[5, 6, 7], [5, 6, 7]]) == 2  # identical rows: the last token stays each row's
    assert common_prefix_length([[5], [5, 6]]) == 0  # a one-token row has nothing to share
    assert common_prefix_length([[1, 2], [3, 2]]) == 0
    assert common_prefix_length([[1, 2, 3]]) == 0  # one row: nothing to share with
    # run once per group instead of once per row only when that saves enough tokens to pay for a forward
    opening = [7] * 40
    assert MIN_PREFIX_TOKENS_SAVED == 64
    assert worth_sharing([opening + [1], opening + [2], opening + [3]]) == 40  # 2 x 40 tokens saved
    assert worth_sharing([opening + [1], opening + [2], opening + [3]], groups=2) == 0  # 40 saved
    assert worth_sharing([opening + [1], opening + [2]]) == 0


def test_a_prefix_every_prompt_opens_with_runs_once_per_key(base: ResidentBase) -> None:
    """Distinct prompts that open alike (a system prompt) run the shared tokens once per key, then each prompt's
    rest, then the completions: the whole rows' log-probs and gradients (float32)."""
    g = torch.Generator().manual_seed(2)
    system = torch.randint(10, 400, (20,), generator=g).tolist()  # (6 prompts - 2 keys) x 20 tokens saved
    tails = [torch.randint(10, 400, (n,), generator=g).tolist() for n in (1, 4, 3)]
    prompts = [system + tails[i % 3] for i in range(7)]
    completions = [torch.randint(10, 400, (n,), generator=g).tolist() for n in (2, 0, 5, 1, 3, 4, 2)]
    keys = [0, 0, 0, 1, 1, 1, 1]  # two groups (two adapters in a one-pass step): the prefix runs once for each
    results = {share: _pass(base, share, (prompts, completions), keys) for share in (True, False)}
    (lp, mask, grads, shapes), (whole_lp, whole_mask, whole_grads, whole_shapes) = results[True], results[False]
    assert whole_shapes == [(7, 20 + 3 + 5)]  # the longest row: tail 3, completion 5
    # the prefix for each key, 6 distinct (key, prompt)s' rest (the longest 4 tokens), every completion but its last
    assert shapes == [(2, 20), (6, 4), (7, 4)]
    assert torch.equal(mask, whole_mask)
    lp_err = max_relative_error(lp, whole_lp)
    assert lp_err < LOGPROB_TOL, lp_err
    assert float(whole_lp.abs().max()) > 1.0
    assert_gradients_close(grads, whole_grads, GRAD_TOL)


@pytest.mark.parametrize("window", [8, 1024])
def test_a_sliding_window_model_shares_a_prefix_only_when_every_row_fits_its_window(
    smollm2_model: Path, tmp_path: Path, window: int
) -> None:
    """Gemma 3's local layers mask by distance between cache slots, not by position: the left pads between a short
    prompt's shared prefix and its rest would push prefix tokens out of a window they are inside of (a hostile
    pass measured log-probs off by 0.29 nats at window 8). A pass whose rows could reach the window runs no
    prefix stage; one that cannot does. Both give the whole rows' log-probs and gradients."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.model import store as model_store
    from trainer.model.base import attention_window

    tiny = model_store.build_tiny(model_store.TinyArchitecture.GEMMA3, tmp_path / "tiny", tokenizer_from=smollm2_model)
    model = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)
    model.config.sliding_window = window
    with torch.no_grad():
        model.model.norm.weight.fill_(9.0)  # peaked, as `peaked_model` (Gemma's norm scales by 1 + w)
    model.save_pretrained(tmp_path / "model")
    AutoTokenizer.from_pretrained(tiny.path).save_pretrained(tmp_path / "model")
    gemma = _with_random_adapter(load_base(ModelConfig(name=str(tmp_path / "model"), dtype="float32", device="cpu")), 5)
    assert attention_window(gemma.model.get_base_model()) == window
    g = torch.Generator().manual_seed(5)
    system = torch.randint(10, 400, (40,), generator=g).tolist()
    prompts = [system + torch.randint(10, 400, (n,), generator=g).tolist() for n in (1, 12, 2)]
    completions = [torch.randint(10, 400, (4,), generator=g).tolist() for _ in prompts]
    results = {share: _pass(gemma, share, (prompts, completions)) for share in (True, False)}
    (lp, _, grads, shapes), (whole_lp, _, whole_grads, _) = results[True], results[False]
    lp_err = max_relative_error(lp, whole_lp)
    assert lp_err < LOGPROB_TOL, lp_err
    assert_gradients_close(grads, whole_grads, GRAD_TOL)
    # rows of up to 52 + 4 tokens: inside a window of 1024, the 40-token prefix runs once; at 8 it does not
    assert shapes == ([(1, 40), (3, 12), (3, 3)] if window == 1024 else [(3, 56)])  # else rows whole
