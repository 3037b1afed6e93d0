"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", arXiv:2505.22617): PPO variants that keep the policy's entropy from collapsing by restraining the few
tokens whose advantage and log-prob covary most, the ones that drive entropy down.

Both select tokens within the batch they are given, as verl's do: here one micro-batch (on one DP rank). The
covariance is centred on that micro-batch's means and the number selected is a fraction of its response tokens
(at least one), so the result depends on how the mini-batch is cut into micro-batches: with the same
`micro_batch_size` (rows per micro-batch on each rank, no token budget) every TP/PP/DP layout cuts the same
micro-batches and gives the same update; a token budget (`max_tokens_per_micro_batch`) or another
`micro_batch_size` changes which tokens are selected. The interface is policy_losses'.
"""

import torch

from verl_mega.algorithms.masked import agg_loss, masked_mean
from verl_mega.algorithms.policy_losses import (
    check_policy_loss_inputs,
    clip_range,
    clipped_surrogate,
    log_ratio,
    ppo_kl,
    register_policy_loss,
    weighted,
)

# Clip-Cov picks its tokens at random among the candidates (verl from the global RNG). A generator seeded
# alike on every call makes the pick a function of the micro-batch alone, the same at every layout and on resume.
_SELECTION_SEED = 0


def token_covariance(advantages, log_prob, response_mask):
    """Each response token's term of Cov(A, log pi): (A - mean A) * (log pi - mean log pi), the means over the
    micro-batch's response tokens; no gradient (it only selects)."""
    log_prob = log_prob.detach()
    return (advantages - masked_mean(advantages, response_mask)) * (log_prob - masked_mean(log_prob, response_mask))


def selection_count(fraction: float, response_mask, knob: str) -> int:
    """floor(fraction * the micro-batch's response tokens), at least 1 (verl's count)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"{knob} must be in (0, 1], got {fraction}")
    return max(int(fraction * int((response_mask > 0).sum())), 1)


@register_policy_loss("clip_cov", "clip-cov", metrics=("pg_clipfrac", "ppo_kl"))
def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                                 rollout_is_weights=None, clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                                 clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, **_other_knobs):
    """Clip-Cov: PPO's clipped surrogate (no dual-clip), with the gradient of a few tokens cut.

    Candidates are the response tokens PPO did not clip whose covariance term lies in (clip_cov_lb, clip_cov_ub);
    clip_cov_ratio of the micro-batch's response tokens (at least one, at most the candidates) are drawn among
    them at random and their loss set to 0. Depends on the micro-batch (see the module docstring). Metrics:
    pg_clipfrac (the share of tokens cut, as verl counts it), ppo_kl.
    """
    check_policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    count = selection_count(clip_cov_ratio, response_mask, "clip_cov_ratio")
    token_log_ratio = log_ratio(old_log_prob, log_prob)
    pg_losses, clipped = clipped_surrogate(token_log_ratio.exp(), advantages, low, high)

    covariance = token_covariance(advantages, log_prob, response_mask)
    candidates = (response_mask > 0) & ~clipped & (covariance > clip_cov_lb) & (covariance < clip_cov_ub)
    positions = candidates.flatten().nonzero()[:, 0]  # row-major: the same order however wide the micro-batch
    draw = torch.randperm(len(positions), generator=torch.Generator().manual_seed(_SELECTION_SEED))[:count]
    cut = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
    cut[positions[draw.to(positions.device)]] = True
    cut = cut.reshape(candidates.shape)

    pg_losses = pg_losses.masked_fill(cut, 0.0)
    pg_loss = agg_loss(weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    return pg_loss, {"pg_clipfrac": masked_mean(cut, response_mask).detach(),
                     "ppo_kl": ppo_kl(token_log_ratio, response_mask)}


@register_policy_loss("kl_cov", "kl-cov", metrics=("ppo_kl", "ppo_kl_abs"))
def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                               rollout_is_weights=None, kl_cov_ratio=0.0002, ppo_kl_coef=0.1, **_other_knobs):
    """KL-Cov: the unclipped surrogate -A * r, plus a penalty ppo_kl_coef * |log r| on the tokens of largest
    covariance term: kl_cov_ratio of the micro-batch's response tokens (at least one). No ratio clipping: the
    penalty is what restrains the update. Depends on the micro-batch (see the module docstring). Metrics: ppo_kl
    (k1, as for every loss), ppo_kl_abs (mean |log r|, what verl logs as this loss's ppo_kl).
    """
    check_policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    count = selection_count(kl_cov_ratio, response_mask, "kl_cov_ratio")
    token_log_ratio = log_ratio(old_log_prob, log_prob)
    valid = response_mask > 0
    covariance = token_covariance(advantages, log_prob, response_mask).masked_fill(~valid, -torch.inf)
    # A stable sort breaks ties in row-major order, the same however many padding columns the micro-batch has.
    largest = covariance.flatten().argsort(descending=True, stable=True)[:count]
    penalised = torch.zeros(covariance.numel(), dtype=torch.bool, device=covariance.device)
    penalised[largest] = True
    penalty = ppo_kl_coef * token_log_ratio.abs() * penalised.reshape(covariance.shape)

    pg_losses = -advantages * token_log_ratio.exp() + penalty
    pg_loss = agg_loss(weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    return pg_loss, {"ppo_kl": ppo_kl(token_log_ratio, response_mask),
                     "ppo_kl_abs": masked_mean(token_log_ratio.abs(), response_mask).detach()}
