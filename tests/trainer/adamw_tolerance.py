"""How far two float32 runs of the same AdamW steps may drift apart, element by element.

Two update modes (sequential and one-pass, prompts shared or not, chunked or not)
sum the same products in a different order, so their gradients agree only to
float32 rounding: the gradient tests bound the difference by ``grad_tol`` times
the tensor's largest gradient. AdamW turns that into a weight difference that
depends on the element (torch.optim.AdamW, Loshchilov & Hutter 2019):

    update = lr * m_hat / (sqrt(v_hat) + eps)

A gradient error ``delta`` moves ``m_hat`` and ``sqrt(v_hat)`` by at most
``delta`` each, so one step's update moves by at most
``2 * lr * delta / (sqrt(v_hat) + eps)``, and never by more than ``2 * lr``
(``|m_hat| / sqrt(v_hat)`` is at most 1 on the first step and stays near it at
the default betas: the whole update flips sign at worst). Over ``steps`` steps:

    tol = steps * lr * min(2, 2 * delta / (sqrt(v_hat) + eps)),
    delta = grad_tol * max(sqrt(v_hat)) over the tensor (the RMS gradient stands in for its size)

An element whose gradient was near zero (``v_hat`` tiny, e.g. a row of ``lora_A``
whose input tokens a batch barely used) may therefore move by up to about the
learning rate on a rounding difference; an element with a gradient of the
tensor's own size must agree to ``2 * steps * lr * grad_tol``. A real one-off
bug (a row dropped, a position shifted, a wrong adapter's rows) changes the
gradients by O(1) on the large elements too, which this tolerance still
catches; ``max_loose_share`` also bounds how many elements may use the loose end.
"""

from __future__ import annotations

import torch

ADAM_BETA2 = 0.999  # torch.optim.AdamW's default, which the adapter stores use
ADAM_EPS = 1e-8


def adamw_weight_tolerance(exp_avg_sq: torch.Tensor, step: float, lr: float, grad_tol: float) -> torch.Tensor:
    """Per-element bound on ``|w_a - w_b|`` after ``step`` AdamW steps whose gradients differ by ``grad_tol``
    (relative to the tensor's largest). ``exp_avg_sq`` is the reference run's second moment (not bias-corrected)."""
    v_hat = exp_avg_sq.double() / (1.0 - ADAM_BETA2**step)
    rms = v_hat.sqrt()
    delta = grad_tol * float(rms.max())
    per_step = torch.clamp(2.0 * delta / (rms + ADAM_EPS), max=2.0)
    return (step * lr * per_step).to(exp_avg_sq.dtype)


def assert_adamw_weights_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    lr: float,
    grad_tol: float,
    atol: float = 1e-7,
    max_loose_share: float = 0.02,
    label: object = "",
) -> None:
    """Every ``weight/<key>`` of ``got`` within :func:`adamw_weight_tolerance` of ``want`` (a snapshot with
    ``exp_avg_sq/<key>`` and ``step/<key>``), and at most ``max_loose_share`` of a tensor's elements
    differing by more than ``atol + 2 * step * lr * grad_tol`` (the bound of an element of typical size)."""
    assert set(got) == set(want), label
    for key, w in want.items():
        if key.startswith("step/"):
            assert torch.equal(got[key], w), (label, key)
        if key.startswith(("exp_avg/", "exp_avg_sq/")):  # moments are sums of gradients (squared): relative bound
            err = float((got[key] - w).abs().max() / w.abs().max())
            assert err < 4 * grad_tol, (label, key, err)
        if not key.startswith("weight/"):
            continue
        name = key.removeprefix("weight/")
        step = float(want[f"step/{name}"])
        tol = atol + adamw_weight_tolerance(want[f"exp_avg_sq/{name}"], step, lr, grad_tol)
        diff = (got[key] - w).abs()
        worst = int(torch.argmax(diff - tol))
        assert bool((diff <= tol).all()), (
            label,
            name,
            f"diff {float(diff.flatten()[worst]):.3g} > tol {float(tol.flatten()[worst]):.3g}",
        )
        loose = float((diff > atol + 2.0 * step * lr * grad_tol).double().mean())
        assert loose <= max_loose_share, (label, name, f"{loose:.1%} of elements past the typical bound")
