"""The optimal token baseline (OTB, verl's `optimal_token_baseline` and `tir_optimal_token_baseline`).

Per prompt group and per response position t, the baseline that minimises the policy gradient's variance,
with the gradient's squared norm estimated from forward probabilities alone (the logit-gradient proxy):

    B_t = sum_i G_t^i W_t^i / (sum_i W_t^i + eps),   W_t = sum_{j <= t} w_j,   w_j = 1 - 2 pi_j + sum_v pi_v^2

where G_t is the reward-to-go, pi_j the probability of the sampled token under the training policy (the old
log-probs) and sum_v pi_v^2 the distribution's collision probability at that position (`sum_pi_squared`).
The advantage is G_t - B_t on the response's tokens. Rows with no response token take no part in a group's
baseline; a group of one response has baseline 0 (its advantage is its return).
"""

import torch

from verl_mega.algorithms.advantages import prompt_groups, register_adv_est, reward_to_go
from verl_mega.algorithms.masked import check_same_shape


def token_energy(old_log_probs, sum_pi_squared):
    """w_t = 1 - 2 pi_t + sum_v pi_v^2 = (1 - pi_t)^2 + the other tokens' squared probabilities: the squared
    norm of log pi_t's gradient with respect to the logits (the logit-gradient proxy)."""
    return 1 - 2 * old_log_probs.exp() + sum_pi_squared


def _group_baselines(returns, energy, mask, index, handle_zero_tail, epsilon):
    """B_t per row ([B, T], 0 where a row has no baseline), rows aligned by position t along dim 1."""
    cumulative = (energy * mask).cumsum(dim=-1) * mask
    lengths = mask.sum(dim=-1)
    group_ids = prompt_groups(index, returns.shape[0], returns.device)
    baselines = torch.zeros_like(returns)
    for group in torch.unique(group_ids[lengths > 0]):
        members = ((group_ids == group) & (lengths > 0)).nonzero().flatten()
        if len(members) == 1:
            continue
        weights = cumulative[members]
        baselines[members] = (returns[members] * weights).sum(dim=0) / (weights.sum(dim=0) + epsilon)
        if handle_zero_tail:
            _zero_longest_tail(baselines, members, lengths[members])
    return baselines


def _zero_longest_tail(baselines, members, lengths):
    """Where one response is strictly the group's longest, its baseline past the runner-up's length is 0: only
    it reaches those positions, so its own return would be its baseline and its advantage there 0."""
    ranked = torch.sort(lengths, descending=True).values
    longest = (lengths == ranked[0]).nonzero().flatten()
    if len(longest) == 1 and ranked[0] > ranked[1]:
        baselines[members[longest[0]], int(ranked[1]):] = 0.0


def _check_token_inputs(token_level_rewards, response_mask, **tensors):
    check_same_shape("token_level_rewards", token_level_rewards, response_mask=response_mask, **tensors)


@register_adv_est("optimal_token_baseline")
def compute_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                             sum_pi_squared, *, handle_zero_tail=False, epsilon=1e-8):
    """OTB: G_t - B_t with the baseline of this module's docstring, positions aligned by column.
    handle_zero_tail: see `_zero_longest_tail` (off here by default, as in verl)."""
    _check_token_inputs(token_level_rewards, response_mask, old_log_probs=old_log_probs,
                        sum_pi_squared=sum_pi_squared)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = reward_to_go(token_level_rewards, mask)
    energy = token_energy(old_log_probs, sum_pi_squared)
    baselines = _group_baselines(returns, energy, mask, index, handle_zero_tail, epsilon)
    return (returns - baselines) * mask, returns


def truncated_is_weights(old_log_probs, rollout_log_probs, threshold):
    """min(pi_train / pi_rollout, threshold) per token, from the log-probs (the ratio is capped before exp)."""
    return (old_log_probs - rollout_log_probs).clamp(max=torch.log(torch.tensor(float(threshold)))).exp()


@register_adv_est("tir_optimal_token_baseline")
def compute_tir_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                                 sum_pi_squared, rollout_log_probs, *, tir_is_threshold=2.0,
                                                 handle_zero_tail=True, epsilon=1e-8):
    """OTB for tool-integrated reasoning (multi-turn): each response's own tokens are aligned by their count,
    so masked-out tokens (tool observations) between turns take no position; each token's w_t is scaled by
    rho_t^2, rho_t = min(pi_train / pi_rollout, tir_is_threshold), the truncated importance weight of the
    rollout engine's sample under the training policy, which is the baseline that minimises the variance of
    the importance-weighted gradient. handle_zero_tail is on by default, as in verl."""
    _check_token_inputs(token_level_rewards, response_mask, old_log_probs=old_log_probs,
                        sum_pi_squared=sum_pi_squared, rollout_log_probs=rollout_log_probs)
    mask = response_mask.bool()
    returns = reward_to_go(token_level_rewards, mask.to(token_level_rewards.dtype))
    rho = truncated_is_weights(old_log_probs, rollout_log_probs, tir_is_threshold)
    energy = token_energy(old_log_probs, sum_pi_squared) * rho**2
    # Compacted: row i's k-th response token at column k, wherever it sits in the response.
    compact_mask = torch.arange(mask.shape[1], device=mask.device) < mask.sum(dim=-1, keepdim=True)
    compacted = {name: torch.zeros_like(returns).masked_scatter(compact_mask, values[mask])
                 for name, values in (("returns", returns), ("energy", energy))}
    baselines = _group_baselines(compacted["returns"], compacted["energy"], compact_mask.to(returns.dtype),
                                 index, handle_zero_tail, epsilon)
    advantages = torch.zeros_like(returns).masked_scatter(mask, (compacted["returns"] - baselines)[compact_mask])
    return advantages, returns
