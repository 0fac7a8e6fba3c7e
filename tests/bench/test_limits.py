"""The limit arithmetic of bench/limits.py and the (b)-against-limits lines of bench/multilora_report.py."""

from __future__ import annotations

import pytest

from bench.limits import (
    EngineBound,
    Limits,
    ModelShape,
    decode_bound_tok_s,
    engine_bound,
    forward_flops,
    rate_line,
    train_flops,
)
from bench.multilora_report import RoundWork, limit_lines

# SmolLM2-135M-Instruct's config.json (the fields ModelShape reads)
SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def test_smollm2_shape_counts_its_published_135m_weights() -> None:
    shape = ModelShape.from_config(SMOLLM2)
    # per layer: q 576x576, k/v 576x192, o 576x576, MLP 3 x 576x1536
    assert shape.layer_linear_params == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    assert shape.params == shape.layer_linear_params + 49152 * 576  # tied: the embedding once
    assert 134e6 < shape.params < 135e6
    untied = ModelShape.from_config(SMOLLM2 | {"tie_word_embeddings": False})
    assert untied.params == shape.params + 49152 * 576


def test_lora_params_per_target_module() -> None:
    shape = ModelShape.from_config(SMOLLM2)
    # r=8 on q/k/v/o: A r x in, B out x r, 30 layers
    expected = 30 * 8 * ((576 + 576) + (576 + 192) + (576 + 192) + (576 + 576))
    assert shape.lora_params(8, ("q_proj", "k_proj", "v_proj", "o_proj")) == expected


def test_head_dim_and_kv_heads_default_from_the_hidden_size() -> None:
    shape = ModelShape.from_config({k: v for k, v in SMOLLM2.items() if k not in ("head_dim", "num_key_value_heads")})
    assert shape.head_dim == 64 and shape.kv_heads == 9


def test_decode_bound_is_sequences_times_steps_per_second() -> None:
    # 0.5 GB of weights per step at 20 GB/s: 40 steps/s; 64 sequences in flight gain a token each step
    assert decode_bound_tok_s(0.5e9, 20e9, 64) == pytest.approx(2560.0)
    assert decode_bound_tok_s(0.5e9, 20e9, 1) == pytest.approx(40.0)


def _host_bound(shape: ModelShape, weights: float, *, prefill: float, decode: float, in_flight: int) -> EngineBound:
    """:func:`engine_bound` on a 20 GB/s, 50 GFLOP/s host."""
    return engine_bound(
        shape,
        prefill_tokens=prefill,
        decode_tokens=decode,
        in_flight=in_flight,
        weight_bytes_per_step=weights,
        bandwidth_B_s=20e9,
        flop_s=50e9,
    )


def test_engine_bound_is_the_larger_of_compute_and_weight_reads() -> None:
    shape = ModelShape.from_config(SMOLLM2)
    weights = shape.params * 4
    # 64 sequences in flight on a 50 GFLOP/s, 20 GB/s host: ~0.27 GFLOP per token, so compute binds
    batch = _host_bound(shape, weights, prefill=1000, decode=640, in_flight=64)
    assert batch.compute_s == pytest.approx(forward_flops(shape, 1640, 640) / 50e9)
    assert batch.reads_s == pytest.approx(10 * weights / 20e9)  # 640 tokens / 64 in flight = 10 steps
    assert batch.binding == "compute" and batch.seconds == batch.compute_s
    # one sequence, no prompt: every token is a step that reads all weights, so the bandwidth binds
    alone = _host_bound(shape, weights, prefill=0, decode=640, in_flight=1)
    assert alone.binding == "memory bandwidth" and alone.seconds == pytest.approx(640 * weights / 20e9)


def test_flops_count_layers_per_token_and_the_lm_head_per_kept_position() -> None:
    shape = ModelShape.from_config(SMOLLM2)
    assert forward_flops(shape, 10, 0) == 2 * shape.layer_linear_params * 10
    assert forward_flops(shape, 0, 3) == 2 * 576 * 49152 * 3
    assert train_flops(shape, 10, 3) == 2 * forward_flops(shape, 10, 3)


def test_rate_line_prints_the_share_of_the_bound() -> None:
    assert (
        rate_line("rollout decode", 90.0, 3600.0, "tok/s")
        == "rollout decode: 90.0 tok/s = 2.5% of the bound 3,600 tok/s"
    )


def _work(**changes: object) -> RoundWork:
    values: dict = dict(
        k=8,
        steps=3,
        prompts=4,
        group=6,
        eval_prompts=32,
        prompt_tokens_mean=40.0,
        rollout_tokens=2000.0,
        eval_length_mean=3.0,
        lora_rank=8,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
    )
    return RoundWork(**(values | changes))


def test_prompt_sharing_counts_each_prompt_once_per_candidate_and_step() -> None:
    shared, whole = _work(), _work(share_prompts=False)
    assert shared.rows == 8 * 3 * 4 * 6
    assert shared.trainer_tokens() == 8 * 3 * 4 * 40.0 + 2000.0
    assert whole.trainer_tokens() == 8 * 3 * 4 * 6 * 40.0 + 2000.0
    assert shared.logit_positions() == 2000.0 + shared.rows


def test_limit_lines_put_each_phase_against_its_bound() -> None:
    shape = ModelShape.from_config(SMOLLM2)
    limits = Limits(bandwidth_B_s=20e9, matmul_flop_s={"bfloat16": 100e9, "float32": 50e9}, threads=2)
    phases = {"time/rollout_s": 20.0, "time/evaluate_s": 10.0, "time/reference_s": 1.0, "time/forward_backward_s": 4.0}
    lines = limit_lines(limits, shape, _work(), phases)
    assert lines[0].startswith("measured limits (2 threads): memory bandwidth 20.0 GB/s")
    weights = shape.params * 4 + 8 * shape.lora_params(8, ("q_proj", "k_proj", "v_proj", "o_proj")) * 4
    # rollouts: 8 x 3 x 4 prompts of 40 tokens prefilled once (n samples share them), 2000 tokens decoded, all
    # 192 sequences in flight (vLLM's --max-num-seqs is 256); float32 matmul at 50 GFLOP/s
    rollout = _host_bound(shape, weights, prefill=8 * 3 * 4 * 40, decode=2000, in_flight=192)
    assert rollout.binding == "compute"
    assert lines[1].startswith(f"rollout decode: 100.0 tok/s = {100.0 / (2000 / rollout.seconds):.1%} of the bound")
    assert "bound: compute" in lines[1] and "192 sequences in flight" in lines[1]
    # evaluation: 9 versions x 32 prompts, each prefilled by every version, 3 tokens each, in 10 s
    answers = 9 * 32
    evaluate = _host_bound(shape, weights, prefill=answers * 40, decode=answers * 3, in_flight=256)
    assert lines[2].startswith(f"evaluate decode: 86.4 tok/s = {86.4 / (answers * 3 / evaluate.seconds):.1%} of")
    fwd = forward_flops(shape, _work().trainer_tokens(), _work().logit_positions())
    assert lines[3].startswith(f"reference forward: {fwd / 1e9:,.1f} GFLOP/s = {fwd / 100e9:.1%} of the bound 100")
    assert lines[4].startswith(f"forward/backward: {2 * fwd / 4 / 1e9:,.1f} GFLOP/s")
    assert len(limit_lines(limits, shape, _work(), {})) == 1  # phases that did not run print nothing
