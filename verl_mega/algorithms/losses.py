"""PPO policy, value and entropy losses. Each takes a loss_agg_mode (see masked.LOSS_AGG_MODES)."""

import torch

from verl_mega.algorithms.masked import agg_loss, check_same_shape, masked_mean
from verl_mega.algorithms.registry import Registry

POLICY_LOSSES = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register
get_policy_loss_fn = POLICY_LOSSES.get

# Keep exp() finite when the policy has drifted far from the one that sampled the batch.
_MAX_LOG_RATIO = 20.0


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode="token-mean",
    clip_ratio=0.2,
    clip_ratio_low=None,
    clip_ratio_high=None,
    clip_ratio_c=3.0,
    rollout_is_weights=None,
):
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher) and dual-clip (Ye et al. 2020).

    The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high] (each defaults to clip_ratio). For
    negative advantages the loss is further capped at clip_ratio_c * |A|. `rollout_is_weights` (detached
    [B, R], None: none) multiply each token's loss before aggregation: the rollout correction's weights.
    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower); the last three are detached metrics.
    """
    check_same_shape(
        "log_prob", log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask
    )
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1.0, got {clip_ratio_c}")
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high

    log_ratio = (log_prob - old_log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    ppo_kl = masked_mean(-log_ratio, response_mask)

    unclipped_losses = -advantages * ratio
    clipped_losses = -advantages * ratio.clamp(1 - low, 1 + high)
    ppo_losses = torch.maximum(unclipped_losses, clipped_losses)
    pg_clipfrac = masked_mean(clipped_losses > unclipped_losses, response_mask)

    # With A < 0 the max above grows without bound in the ratio; one stale, very unlikely token could
    # then dominate the update, so dual-clip caps it.
    dual_clip_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((ppo_losses > dual_clip_bound) & negative, response_mask)
    pg_losses = torch.where(negative, torch.minimum(ppo_losses, dual_clip_bound), ppo_losses)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac.detach(), ppo_kl.detach(), pg_clipfrac_lower.detach()


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
