"""Shared helpers of the trainer tests (tiny model, small threads)."""

from __future__ import annotations

import torch

torch.set_num_threads(2)
