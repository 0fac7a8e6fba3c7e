"""How far two float32 runs of the same AdamW steps may drift apart, element by element.

Two update modes (sequential and one-pass, prompts shared or not, chunked or not)
sum the same products in a different order, so their gradients agree only to
float32 rounding: the gradient tests bound the difference by ``grad_tol`` times
the tensor's largest gradient (``GRAD_TOL`` in ``float32_tolerance.py``). AdamW
turns that into a weight difference that depends on the element
(torch.optim.AdamW, Loshchilov & Hutter 2019):

    update = lr * m_hat / (sqrt(v_hat) + eps)

A gradient error ``delta`` moves ``m_hat`` and ``sqrt(v_hat)`` by at most
``delta`` each, so one step's update moves by at most
``2 * lr * delta / (sqrt(v_hat) + eps)``, and never by more than ``2 * lr``
(``|m_hat| / sqrt(v_hat)`` is at most 1 on the first step and at most 1.002 on
the second at the default betas: the whole update flips sign at worst). Summed
over the steps ``s``:

    tol = sum_s lr * min(2, 2 * delta / (sqrt(v_hat_s) + eps)),
    delta = grad_tol * max_s sqrt(s) * max(sqrt(v_hat_s))   (a bound on grad_tol * the largest gradient)

with ``v_hat_s`` the reference run's bias-corrected second moment after step
``s`` (its snapshots after the earlier steps are ``history``; without them every
step is bounded with the last one's, which is exact for one step).

An element whose gradient was near zero (``v_hat`` tiny, e.g. a column of ``lora_A``
whose input features the batch barely used, or a sum that cancels) may
therefore move by up to about the learning rate on a rounding difference: on a
CPU with AMX one element of the tiny model differed by 6.8e-6 after two steps,
where the old test allowed ``1e-6 + 1e-4 * |w|`` (issue 31). An element with a
gradient of the tensor's own size must agree to about ``2 * steps * lr * grad_tol``.
A real one-off bug (a row dropped, a position shifted, a wrong adapter's rows)
changes the gradients by O(1) on the large elements too, which this tolerance
still catches; ``max_loose_share`` also bounds how many elements may use the
loose end, and the moments are compared against their own float32 bound.

From the second step on, each run's gradient is taken at its own weights, which
already differ by the bound above: the premise (gradients agree to ``grad_tol``)
is checked by the moments, which are sums of the steps' gradients (squared).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

ADAM_BETA1 = 0.9  # torch.optim.AdamW's defaults, which the adapter stores use
ADAM_BETA2 = 0.999
ADAM_EPS = 1e-8


def _rms(snapshot: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """``sqrt(v_hat)`` of parameter ``name`` in an adapter-store snapshot (bias-corrected, float64)."""
    step = float(snapshot[f"step/{name}"])
    return (snapshot[f"exp_avg_sq/{name}"].double() / (1.0 - ADAM_BETA2**step)).sqrt()


def adamw_weight_tolerance(
    snapshots: Sequence[Mapping[str, torch.Tensor]], name: str, lr: float, grad_tol: float
) -> tuple[torch.Tensor, float]:
    """Per-element bound on ``|w_a - w_b|`` of parameter ``name`` after the reference run's steps, whose
    gradients differ from the other run's by ``grad_tol`` (relative to the tensor's largest), and the bound of
    an element of the tensor's largest RMS gradient (the typical element).

    ``snapshots``: the reference run's snapshots (``exp_avg_sq/<name>``, ``step/<name>``) after each step, the
    last one the compared state; a single snapshot bounds every step with its second moment. The largest
    gradient of step ``s`` is at most ``sqrt(s) * max(sqrt(v_hat_s))`` (``v_hat_s`` averages the squared
    gradients with weights of about ``1 / s`` or more), exact for ``s = 1``."""
    last = snapshots[-1]
    steps = int(float(last[f"step/{name}"]))
    known = {int(float(s[f"step/{name}"])): _rms(s, name) for s in snapshots}
    rms_s = [known[min((k for k in known if k >= s), default=steps)] for s in range(1, steps + 1)]
    delta = grad_tol * max(((s + 1) * 1.001) ** 0.5 * float(rms.max()) for s, rms in enumerate(rms_s))
    tol = torch.zeros_like(rms_s[-1])
    typical = 0.0
    for rms in rms_s:
        tol += lr * torch.clamp(2.0 * delta / (rms + ADAM_EPS), max=2.0)
        typical += lr * min(2.0, 2.0 * delta / (float(rms.max()) + ADAM_EPS))
    return tol.to(last[f"exp_avg_sq/{name}"].dtype), typical


def assert_adamw_weights_close(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    lr: float,
    grad_tol: float,
    history: Sequence[Mapping[str, torch.Tensor]] = (),
    atol: float = 1e-7,
    max_loose_share: float = 0.02,
    label: object = "",
) -> tuple[float, str]:
    """Every ``weight/<key>`` of ``got`` within :func:`adamw_weight_tolerance` of ``want`` (a snapshot with
    ``exp_avg_sq/<key>`` and ``step/<key>``; ``history``: the reference run's snapshots after its earlier
    steps), at most ``max_loose_share`` of a tensor's elements differing by more than
    ``atol`` + the bound of an element of the tensor's largest RMS gradient, the step counts equal and
    the moments within their float32 bound.

    The moments after ``S`` steps: ``exp_avg = sum_s (1 - b1) b1^(S-s) g_s`` moves by at most
    ``(1 - b1^S) * grad_tol * max|g|``, and ``max|g| <= sqrt(S) * max(sqrt(v_hat))`` (``v_hat`` averages the
    squared gradients with weights >= 1 / S at the default betas); ``exp_avg_sq`` (a positive sum of ``g^2``)
    moves by ``2 |g| delta`` per term, at most ``2 * S * grad_tol`` of its largest. A factor 2 of slack covers
    the gradient taken at weights that already differ from the second step on.

    Returns the largest ``diff / tol`` over the weights and moments (below 1: within every bound) and its key,
    for the test's printed margin."""
    assert set(got) == set(want), label
    worst = (0.0, "")
    for key, w in want.items():
        if key.startswith("step/"):
            assert torch.equal(got[key], w), (label, key)
            continue
        kind, name = key.split("/", 1)
        steps = float(want[f"step/{name}"])
        diff = (got[key] - w).abs()
        if kind == "exp_avg":
            tol_m = 2.0 * (1.0 - ADAM_BETA1**steps) * grad_tol * steps**0.5 * float(_rms(want, name).max())
            worst = max(worst, (float(diff.max()) / tol_m, key))
            assert float(diff.max()) <= tol_m, (label, key, f"diff {float(diff.max()):.3g} > tol {tol_m:.3g}")
        elif kind == "exp_avg_sq":
            tol_v = 2.0 * 2.0 * steps * grad_tol * float(w.abs().max())
            worst = max(worst, (float(diff.max()) / tol_v, key))
            assert float(diff.max()) <= tol_v, (label, key, f"diff {float(diff.max()):.3g} > tol {tol_v:.3g}")
        elif kind == "weight":
            bound, typical = adamw_weight_tolerance([*history, want], name, lr, grad_tol)
            tol = atol + bound
            at = int(torch.argmax(diff / tol))
            worst = max(worst, (float(diff.flatten()[at] / tol.flatten()[at]), key))
            assert bool((diff <= tol).all()), (
                label,
                name,
                f"diff {float(diff.flatten()[at]):.3g} > tol {float(tol.flatten()[at]):.3g}",
            )
            loose = float((diff > atol + typical).double().mean())
            assert loose <= max_loose_share, (label, name, f"{loose:.1%} of elements past the typical bound")
    return worst
