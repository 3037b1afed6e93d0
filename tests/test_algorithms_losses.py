"""PPO policy loss (asymmetric clip, dual-clip), clipped value loss, entropy."""

import math

import pytest
import torch

from verl_mega.algorithms import agg_loss
from verl_mega.algorithms.losses import (
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
    get_policy_loss_fn,
)


def policy_loss(ratios, advantages, mask=None, **kwargs):
    """Run the loss with old_log_prob = 0 so that ratio = exp(log_prob)."""
    log_prob = torch.tensor([ratios]).log().requires_grad_()
    advantages = torch.tensor([advantages])
    mask = torch.ones_like(advantages) if mask is None else torch.tensor([mask])
    return log_prob, compute_policy_loss(torch.zeros_like(log_prob), log_prob, advantages, mask, **kwargs)


def test_vanilla_policy_loss_hand_computed():
    # clip to [0.8, 1.28], dual-clip c = 3. Per token, loss = max(-A r, -A clip(r)), then min(., c|A|) if A < 0:
    #   A=+1 r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped)
    #   A=+1 r=1.1 -> -1.1 (inside the range)
    #   A=-1 r=0.5 -> max(0.5, 0.8) = 0.8 (clipped)
    #   A=-1 r=5.0 -> max(5.0, 1.28) = 5.0, dual-clipped to 3
    ratios, advantages = [1.5, 1.1, 0.5, 5.0], [1.0, 1.0, -1.0, -1.0]
    _, (pg_loss, clipfrac, ppo_kl, clipfrac_lower) = policy_loss(
        ratios, advantages, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0
    )
    assert pg_loss.item() == pytest.approx((-1.28 - 1.1 + 0.8 + 3.0) / 4)
    assert clipfrac.item() == pytest.approx(2 / 4)
    assert clipfrac_lower.item() == pytest.approx(1 / 4)
    # ppo_kl = mean(old_log_prob - log_prob)
    assert ppo_kl.item() == pytest.approx(-sum(math.log(r) for r in ratios) / 4)


def test_asymmetric_clip_widens_only_the_upper_side():
    # A=+1, r=1.25: outside 1 + 0.2, inside 1 + 0.28
    _, (loss, clipfrac, _, _) = policy_loss([1.25], [1.0], clip_ratio=0.2)
    assert (loss.item(), clipfrac.item()) == (pytest.approx(-1.2), 1.0)
    _, (loss, clipfrac, _, _) = policy_loss([1.25], [1.0], clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert (loss.item(), clipfrac.item()) == (pytest.approx(-1.25), 0.0)
    # A=-1, r=0.75: clipped up to 0.8 with low=0.2, untouched with low=0.3
    _, (loss, clipfrac, _, _) = policy_loss([0.75], [-1.0], clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert (loss.item(), clipfrac.item()) == (pytest.approx(0.8), 1.0)
    _, (loss, clipfrac, _, _) = policy_loss([0.75], [-1.0], clip_ratio_low=0.3, clip_ratio_high=0.28)
    assert (loss.item(), clipfrac.item()) == (pytest.approx(0.75), 0.0)


def test_dual_clip_caps_negative_advantage_loss_and_its_gradient():
    # A=-2, r=10: -A r = 20 is capped at c |A| = 3 * 2 = 6; A=+2, r=10 is only clipped: -2 * 1.2
    log_prob, (pg_loss, _, _, clipfrac_lower) = policy_loss([10.0, 10.0], [-2.0, 2.0], clip_ratio=0.2, clip_ratio_c=3.0)
    assert pg_loss.item() == pytest.approx((6.0 - 2.4) / 2)
    assert clipfrac_lower.item() == pytest.approx(1 / 2)
    pg_loss.backward()
    assert log_prob.grad.abs().max().item() == 0.0  # both tokens sit on a constant bound


def test_policy_loss_ignores_masked_tokens_and_honours_agg_mode():
    # Token 2 is masked (its ratio would make the loss huge). Unmasked: -1 * 1 and -1 * 1 -> -1 each.
    ratios, advantages, mask = [1.0, 1.0, 50.0], [1.0, 1.0, -7.0], [1.0, 1.0, 0.0]
    _, (token_mean, *_) = policy_loss(ratios, advantages, mask)
    assert token_mean.item() == pytest.approx(-1.0)
    _, (token_sum, *_) = policy_loss(ratios, advantages, mask, loss_agg_mode="seq-mean-token-sum")
    assert token_sum.item() == pytest.approx(-2.0)


def test_policy_loss_rejects_bad_input():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss([1.0], [1.0], clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


def test_vanilla_is_registered():
    assert get_policy_loss_fn("vanilla") is compute_policy_loss


def test_value_loss_clips_around_old_values():
    # cliprange 0.5 around v_old = 0, so clipped v = clamp(v, -0.5, 0.5):
    #   v=1.0 R=2.0: (1-2)^2 = 1, (0.5-2)^2 = 2.25 -> 2.25 (clipped counts)
    #   v=1.0 R=0.0: (1-0)^2 = 1, (0.5-0)^2 = 0.25 -> 1
    #   v=0.2 R=1.0: inside the range, (0.2-1)^2 = 0.64
    vpreds = torch.tensor([[1.0, 1.0, 0.2]])
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    old_values = torch.zeros(1, 3)
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, old_values, returns, torch.ones(1, 3), cliprange_value=0.5)
    assert vf_loss.item() == pytest.approx(0.5 * (2.25 + 1.0 + 0.64) / 3)
    assert vf_clipfrac.item() == pytest.approx(1 / 3)


def test_value_loss_shape_mismatch_names_argument():
    with pytest.raises(ValueError, match="returns"):
        zeros = torch.zeros(1, 3)
        compute_value_loss(zeros, zeros, torch.zeros(1, 2), torch.ones(1, 3), cliprange_value=0.5)


def test_entropy_from_logits_and_aggregation():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0]]])
    entropy = entropy_from_logits(logits)
    # uniform over 4 -> log 4; the peaked one matches torch's Categorical
    torch.testing.assert_close(entropy[0, 0], torch.tensor(math.log(4.0)))
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=logits).entropy())
    # mask out the peaked token: the aggregate is the uniform entropy alone
    assert agg_loss(entropy, torch.tensor([[1.0, 0.0]])).item() == pytest.approx(math.log(4.0))
