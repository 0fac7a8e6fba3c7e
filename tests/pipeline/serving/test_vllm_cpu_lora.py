"""The grouped CPU LoRA kernels give the upstream kernels' results, and vLLM loads them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import vllm

from pipeline.serving import vllm_cpu_lora as grouped

UPSTREAM_FILE = Path(vllm.__file__).parent / "lora/ops/torch_ops/lora_ops.py"


@pytest.fixture(scope="module")
def upstream():
    """A private copy of vLLM's reference CPU kernels, untouched by any patch."""
    spec = importlib.util.spec_from_file_location("upstream_torch_lora_ops", UPSTREAM_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["stacked", "grouped"])
def form(request, monkeypatch):
    """Both forms of the kernels: the stacked one (small batches, the default here) and the grouped one (forced)."""
    if request.param == "grouped":
        monkeypatch.setenv(grouped.STACKED_ENV, "0")
    else:
        monkeypatch.delenv(grouped.STACKED_ENV, raising=False)
    return request.param


def _case(tokens=37, d_in=24, d_out=40, rank=8, slots=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=g)
    a = torch.randn(slots, 1, rank, d_in, generator=g)
    b = torch.randn(slots, 1, d_out, rank, generator=g)
    idx = torch.randint(0, slots, (tokens,), generator=g)
    return x, a, b, idx


@pytest.mark.parametrize("one_slot", [False, True], ids=["mixed-slots", "single-slot"])
def test_bgmv_ops_match_upstream(upstream, one_slot, form):
    x, a, b, idx = _case()
    if one_slot:
        idx = torch.full_like(idx, 2)
    h_ref, h_new = torch.zeros(len(x), 8), torch.zeros(len(x), 8)
    upstream.bgmv_shrink(x, a, h_ref, idx, 0.5)
    grouped.bgmv_shrink(x, a, h_new, idx, 0.5)
    torch.testing.assert_close(h_new, h_ref)
    assert h_new.abs().sum() > 0

    base = torch.randn(len(x), 40)
    y_ref, y_new = base.clone(), base.clone()
    upstream.bgmv_expand(h_ref, b, y_ref, idx, add_inputs=True)
    grouped.bgmv_expand(h_ref, b, y_new, idx, add_inputs=True)
    torch.testing.assert_close(y_new, y_ref)

    wide_ref = torch.randn(len(x), 100)
    wide_new = wide_ref.clone()
    upstream.bgmv_expand_slice(h_ref, b, wide_ref, idx, 30, 40, add_inputs=False)
    grouped.bgmv_expand_slice(h_ref, b, wide_new, idx, 30, 40, add_inputs=False)
    torch.testing.assert_close(wide_new, wide_ref)


def test_sgmv_ops_match_upstream(upstream, form):
    """Prefill form: one slot per sequence, expanded over its tokens."""
    x, a, b, _ = _case(tokens=12)
    seq_lens = torch.tensor([5, 4, 3])
    seq_slots = torch.tensor([1, 0, 1])
    meta = (torch.tensor([0, 5, 9]), seq_lens, seq_slots, 3, 5, 12)
    h_ref, h_new = torch.zeros(12, 8), torch.zeros(12, 8)
    upstream.sgmv_shrink(x, a, h_ref, *meta, 2.0)
    grouped.sgmv_shrink(x, a, h_new, *meta, 2.0)
    torch.testing.assert_close(h_new, h_ref)

    y_ref, y_new = torch.zeros(12, 40), torch.zeros(12, 40)
    upstream.sgmv_expand(h_ref, b, y_ref, *meta, add_inputs=False)
    grouped.sgmv_expand(h_ref, b, y_new, *meta, add_inputs=False)
    torch.testing.assert_close(y_new, y_ref)

    z_ref, z_new = torch.ones(12, 90), torch.ones(12, 90)
    upstream.sgmv_expand_slice(h_ref, b, z_ref, *meta, 50, 40, add_inputs=True)
    grouped.sgmv_expand_slice(h_ref, b, z_new, *meta, 50, 40, add_inputs=True)
    torch.testing.assert_close(z_new, z_ref)


def test_negative_slot_means_no_adapter(form):
    """Slot -1 (a base-model request in a mixed batch) gets exactly zero LoRA delta."""
    x, a, b, idx = _case(tokens=10)
    idx[::2] = -1
    h = torch.full((10, 8), 7.0)
    grouped.bgmv_shrink(x, a, h, idx, 1.0)
    assert torch.all(h[::2] == 0)
    assert torch.all(h[1::2] != 0)
    expected_rows = x[1::2] @ a[idx[1::2]].squeeze(1).transpose(1, 2)
    torch.testing.assert_close(h[1::2], torch.diagonal(expected_rows, dim1=0, dim2=1).T)

    y = torch.ones(10, 40)
    grouped.bgmv_expand(torch.randn(10, 8), b, y, idx, add_inputs=True)  # non-zero inputs on the no-adapter rows too
    assert torch.all(y[::2] == 1)
    assert torch.all(y[1::2] != 1)

    none = torch.full_like(idx, -1)  # a batch of base-model requests only
    grouped.bgmv_shrink(x, a, h, none, 1.0)
    assert torch.all(h == 0)


def test_the_form_follows_the_batch_size(monkeypatch):
    """Tokens x slots up to the limit take the stacked form, larger batches the grouped one; both agree."""
    calls = []
    real = grouped.stacked_lora_matmul
    monkeypatch.setattr(grouped, "stacked_lora_matmul", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setenv(grouped.STACKED_ENV, "120")
    small = _case(tokens=40, slots=3)  # 120 tokens x slots: stacked
    large = _case(tokens=41, slots=3)  # 123: grouped
    out_small = grouped.grouped_lora_matmul(small[0], small[1], small[3], torch.float32)
    out_large = grouped.grouped_lora_matmul(large[0], large[1], large[3], torch.float32)
    assert calls == [40]
    monkeypatch.setenv(grouped.STACKED_ENV, "0")
    torch.testing.assert_close(out_small, grouped.grouped_lora_matmul(small[0], small[1], small[3], torch.float32))
    monkeypatch.setenv(grouped.STACKED_ENV, "1000")
    torch.testing.assert_close(out_large, grouped.grouped_lora_matmul(large[0], large[1], large[3], torch.float32))
    assert calls == [40, 41]


def test_register_patches_the_cpu_wrapper(monkeypatch):
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu

    for name in grouped._OPS:  # restored by monkeypatch at teardown
        monkeypatch.setattr(punica_cpu, name, getattr(punica_cpu, name), raising=False)
        monkeypatch.setattr(ops, name, getattr(ops, name))
    monkeypatch.setenv(grouped.ENV_SWITCH, "0")
    grouped.register()
    assert punica_cpu.bgmv_shrink is not grouped.bgmv_shrink
    monkeypatch.setenv(grouped.ENV_SWITCH, "1")
    grouped.register()
    assert punica_cpu.sgmv_expand_slice is grouped.sgmv_expand_slice
    assert ops.bgmv_shrink is grouped.bgmv_shrink


@pytest.mark.integration
def test_vllm_server_loads_the_plugin(vllm_tiny, services_dir):
    """The entry point is installed: the real server's worker logs the swap."""
    log = (services_dir / "logs-tiny" / "vllm.log").read_text(errors="replace")
    assert "grouped CPU LoRA kernels installed" in log
