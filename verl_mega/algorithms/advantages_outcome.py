"""Outcome-reward estimators with other baselines than the group mean: ReMax, OPO, GRPO pass@k, GPG.

Each registers under verl's name and follows verl's math and defaults (verl/trainer/ppo/core_algos.py); the
inputs are named as in advantages.py's vocabulary.
"""

import torch

from verl_mega.algorithms.advantages import (
    broadcast_to_tokens, check_outcome_inputs, group_stats, prompt_groups, register_adv_est, reward_to_go,
)
from verl_mega.algorithms.masked import check_same_shape


@register_adv_est("remax")
def compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask):
    """ReMax (Li et al. 2023): the return from each token minus the score of one greedy response to the same
    prompt (`reward_baselines`, one per sequence), the baseline broadcast over the response's tokens.

    The returns are the undiscounted reward-to-go, so a KL penalty in the token rewards enters them per token,
    as in verl; the greedy baseline is its reward alone.
    """
    check_same_shape("token_level_rewards", token_level_rewards, response_mask=response_mask)
    check_outcome_inputs(reward_baselines, response_mask)
    returns = reward_to_go(token_level_rewards, response_mask)
    advantages = returns - broadcast_to_tokens(reward_baselines, response_mask)
    return advantages, returns


@register_adv_est("opo")
def compute_opo_outcome_advantage(scores, response_mask, index):
    """OPO (Hao et al. 2025, on-policy RL with the optimal baseline): score minus the group's length-weighted
    mean score, sum(len_i * score_i) / sum(len_i), lengths counted in response tokens. A lone response, or a
    group whose responses are all empty, gets baseline 0."""
    check_outcome_inputs(scores, response_mask)
    group_ids = prompt_groups(index, scores.shape[0], scores.device)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    zeros = torch.zeros(int(group_ids.max()) + 1 if group_ids.numel() else 0, dtype=scores.dtype,
                        device=scores.device)
    weighted = zeros.index_add(0, group_ids, lengths * scores)[group_ids]
    total_length = zeros.index_add(0, group_ids, lengths)[group_ids]
    sizes = zeros.index_add(0, group_ids, torch.ones_like(scores))[group_ids]
    has_baseline = (sizes > 1) & (total_length > 0)
    baselines = torch.where(has_baseline, weighted / total_length.clamp_min(1), 0.0)
    advantages = broadcast_to_tokens(scores - baselines, response_mask)
    return advantages, advantages


@register_adv_est("grpo_passk")
def compute_grpo_passk_outcome_advantage(scores, response_mask, index, *, epsilon=1e-6,
                                         norm_adv_by_std_in_grpo=True):
    """GRPO for pass@k (Chen et al. 2025, arXiv:2503.19595): only each group's best response gets an
    advantage, its lead over the runner-up (best - second best), divided by the group's std + epsilon with
    norm_adv_by_std_in_grpo; every other response gets 0. A tie for the best gives the group 0 (the lead is 0);
    the best is the first of them in batch order. Groups need two responses or more (rollout.n >= 2)."""
    check_outcome_inputs(scores, response_mask)
    group_ids = prompt_groups(index, scores.shape[0], scores.device)
    sizes, _, stds = group_stats(scores, index)
    if (sizes < 2).any():
        lone = int((sizes < 2).nonzero()[0])
        raise ValueError(f"grpo_passk needs at least 2 responses per prompt; prompt {index[lone]!r} has 1 "
                         "(set rollout.n >= 2)")
    advantages = torch.zeros_like(scores)
    for group in torch.unique(group_ids):
        members = (group_ids == group).nonzero().flatten()
        ranked = torch.sort(scores[members], descending=True, stable=True)
        best = members[ranked.indices[0]]
        lead = ranked.values[0] - ranked.values[1]
        advantages[best] = lead / (stds[best] + epsilon) if norm_adv_by_std_in_grpo else lead
    advantages = broadcast_to_tokens(advantages, response_mask)
    return advantages, advantages


@register_adv_est("gpg")
def compute_gpg_outcome_advantage(scores, response_mask, index):
    """GPG (Chu et al. 2025, Group Policy Gradient): alpha * (score - group mean), alpha = B / M with B the
    batch's responses and M those whose score is non-zero (at least 1), as verl counts them; so a batch
    where few responses earn a reward gets a larger step instead of a mean diluted by zeros. A lone response
    keeps its score (mean 0); there is no std division (verl's f_norm is 1)."""
    check_outcome_inputs(scores, response_mask)
    sizes, means, _ = group_stats(scores, index)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp_min(1).to(scores.dtype)
    advantages = broadcast_to_tokens(alpha * (scores - torch.where(sizes == 1, 0.0, means)), response_mask)
    return advantages, advantages
