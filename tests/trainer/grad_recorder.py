"""An optimizer for gradient-equality tests: it records the gradients it is asked to step with and steps nothing."""

from __future__ import annotations

import torch


class GradRecorder(torch.optim.SGD):
    """Records the gradients of its parameters at ``step`` (after any clipping), leaving the weights as they are."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, lr=0.0)
        self.grads: list[torch.Tensor] = []

    def step(self, closure=None):  # type: ignore[override]
        self.grads = [p.grad.clone() for group in self.param_groups for p in group["params"]]
