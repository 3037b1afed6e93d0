"""The critic's clipped value loss and the entropy bonus; the policy losses are policy_losses and cov_losses."""

import torch

from verl_mega.algorithms.masked import agg_loss, check_same_shape, masked_mean


def compute_value_loss(vpreds, values, returns, response_mask, *, cliprange_value, loss_agg_mode="token-mean"):
    """Clipped value loss: 0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)).

    `values` are the old predictions the new ones are clipped around. Returns (vf_loss, vf_clipfrac).
    """
    check_same_shape("vpreds", vpreds, values=values, returns=returns, response_mask=response_mask)
    vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_errors = (vpreds - returns) ** 2
    clipped_errors = (vpreds_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(unclipped_errors, clipped_errors), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(clipped_errors > unclipped_errors, response_mask)
    return vf_loss, vf_clipfrac.detach()


def entropy_from_logits(logits):
    """Entropy of the softmax distribution over the last dim: logsumexp(z) - sum(softmax(z) * z)."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
