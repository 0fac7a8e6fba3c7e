"""Losses against hand-computed values on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms.losses import group_advantages, importance_weighted_pg_loss, kl_k3, masked_mean, ppo_clip_loss
from trainer.model.logprobs import token_logprobs


def test_group_advantages_normalise_each_group_and_zero_flat_groups() -> None:
    rewards_PG = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv_PG = group_advantages(rewards_PG)
    # group 0: mean 0.5, population std 0.5 -> +-1
    torch.testing.assert_close(adv_PG[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    assert torch.equal(adv_PG[1], torch.zeros(4))


def test_masked_mean_ignores_padding() -> None:
    values_BT = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_mean(values_BT, mask_BT).item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3


def test_ppo_clip_by_hand_with_clipping_and_padding() -> None:
    # ratios: 1.5 (clipped for A>0), 0.5 (clipped for A<0 side? no: min picks unclipped), pad
    old_BT = torch.zeros(2, 2)
    logprobs_BT = torch.log(torch.tensor([[1.5, 1.0], [0.5, 7.0]])).requires_grad_()
    adv_B = torch.tensor([2.0, -1.0])
    mask_BT = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # last token is padding (ratio 7 must not count)
    loss, clip_frac = ppo_clip_loss(logprobs_BT, old_BT, adv_B, mask_BT, clip_eps=0.2)
    # token 1: min(1.5*2, 1.2*2) = 2.4 -> -2.4 ; token 2: min(1*2, 1*2) = 2 -> -2
    # token 3: A=-1: min(0.5*-1, 0.8*-1) = -0.8 -> +0.8
    assert loss.item() == pytest.approx((-2.4 - 2.0 + 0.8) / 3, rel=1e-6)
    assert clip_frac.item() == pytest.approx(2 / 3)  # ratios 1.5 and 0.5 lie outside [0.8, 1.2]
    loss.backward()
    grad = logprobs_BT.grad
    # clipped tokens give no gradient; the unclipped ratio-1 token gives -A*ratio/3; padding none
    assert grad[0, 0].item() == 0.0 and grad[1, 0].item() == 0.0 and grad[1, 1].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(-2.0 / 3)


def test_kl_k3_by_hand_and_zero_at_equality() -> None:
    logprobs_BT = torch.tensor([[math.log(0.5), math.log(0.2)]])
    ref_BT = torch.tensor([[math.log(0.25), math.log(0.2)]])
    kl_BT = kl_k3(logprobs_BT, ref_BT)
    r = math.log(0.25) - math.log(0.5)
    assert kl_BT[0, 0].item() == pytest.approx(math.exp(r) - r - 1)  # 0.5 - (-0.693) - 1 = 0.193
    assert kl_BT[0, 1].item() == pytest.approx(0.0, abs=1e-7)
    assert (kl_k3(torch.randn(4, 5), torch.randn(4, 5)) >= 0).all()


def test_importance_weighted_pg_truncates_ratios_and_masks() -> None:
    behaviour_BT = torch.log(torch.tensor([[0.5, 0.1], [0.4, 0.4]]))
    logprobs_BT = torch.log(torch.tensor([[0.25, 0.4], [0.4, 0.9]])).requires_grad_()
    adv_B = torch.tensor([1.0, -2.0])
    mask_BT = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, clip_frac = importance_weighted_pg_loss(logprobs_BT, behaviour_BT, adv_B, mask_BT, max_ratio=2.0)
    # weights: 0.5, min(4, 2)=2, 1.0 ; loss = -(0.5*1*lp00 + 2*1*lp01 + 1*-2*lp10) / 3
    lp = logprobs_BT.detach()
    expected = -(0.5 * lp[0, 0] + 2.0 * lp[0, 1] - 2.0 * lp[1, 0]) / 3
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert clip_frac.item() == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logprobs_BT.grad, torch.tensor([[-0.5 / 3, -2.0 / 3], [2.0 / 3, 0.0]]))


def test_token_logprobs_gather() -> None:
    logits_BTV = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    lp_BT = token_logprobs(logits_BTV, torch.tensor([[1, 0]]))
    torch.testing.assert_close(lp_BT, torch.tensor([[math.log(0.5), math.log(0.75)]]))
