"""How closely two float32 code paths that sum the same terms in another order agree (before any optimizer).

The update modes (sequential and one-pass, whole and chunked, prompts shared or
not, the multi-adapter layer's loop and grouped kernel, evaluation in chunks)
compute the same log-probs and gradients from the same products, added up in
another order: other batch shapes and paddings, other chunks, another split of
a prompt and its completion. Each result is then exact only to float32 rounding,
and which rounding depends on the machine: the kernels torch picks for the CPU
(MKL's GEMM path, which differs between Intel and AMD CPUs; oneDNN's ISA; ATen's
vectorised reductions) and the number of threads. A tolerance fitted to one CPU
fails on another (issue 31: a CPU with AMX), so each one here is derived from
float32's unit roundoff ``U`` and the size of the sums, and checked against the
largest error measured under every kernel variant in docs/testing.md
("Equality tests on other CPUs"), which it must exceed by 4x or more.

Errors are measured against the compared tensor's largest entry
(:func:`max_relative_error`), since rounding scales with the magnitudes that are
summed, not with each result: an element that cancels to ~0 keeps the rounding of
its terms.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

U = 2.0**-24  # float32 unit roundoff (half the spacing of floats in [1, 2)): 6.0e-8

LOGPROB_TOL = 1e-6  # ~17 U of the largest |log-prob|
"""Per-token log-probs: a log-prob is a logit minus the log-sum-exp of 49k logits, each a sum of 64 products
after two decoder layers (sums of 64-256 products, attention over <= 16 positions), so a handful of roundings of
the logits' size reach it: measured 1.2e-7 to 2.5e-7 of the largest |log-prob| over the kernel variants (3.8e-6
nats of 15.1 at worst); a shifted position or a wrong row moves them by 0.1 or more."""

GRAD_TOL = 1e-4  # ~1700 U of the largest entry
"""LoRA gradients (before clipping and the optimizer): sums over the step's ~20-60 completion tokens (and over
chunks) of products back-propagated through two layers, and a ``lora_A`` gradient is ``B^T delta x^T``, whose
projection ``B^T delta`` onto r = 2-8 directions sums 64-128 signed terms that partly cancel: the rounding of the
back-propagated signal, which another order changes, then weighs more than in the result. Measured up to 2.2e-5
of the largest entry (candidate c's and a ``k_proj`` ``lora_A`` in the chunked one-pass tests, under MKL's
reproducible GEMM path ``MKL_CBWR=COMPATIBLE``; 1.2e-5 on the default kernels); most tensors agree to 1e-5. A
one-off bug (a row dropped or through the wrong adapter, a position shifted, the KL term left out) moves them by
0.09 to 0.98 of the largest entry in these tests."""


def max_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|``: the measure of every log-prob and gradient comparison."""
    scale = float(want.abs().max())
    assert scale > 0, "a comparison against an all-zero tensor proves nothing"
    return float((got - want).abs().max()) / scale


def assert_gradients_close(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], tol: float = GRAD_TOL, label: object = ""
) -> tuple[float, str]:
    """Every tensor of ``got`` within ``tol`` of ``want``'s by :func:`max_relative_error` (``want``'s tensors
    non-zero). Returns the largest ``error / tol`` and its key, for the test's printed margin."""
    assert set(got) == set(want), label
    worst = (0.0, "")
    for key, ref in want.items():
        err = max_relative_error(got[key], ref)
        worst = max(worst, (err / tol, str(key)))
        assert err < tol, (label, key, err)
    return worst
