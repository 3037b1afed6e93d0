"""Advantage estimators, registered by name (as verl's core_algos), and the inputs each one takes.

An estimator's positional parameters are its inputs, named from one vocabulary the trainer fills:
- token_level_rewards [B, R] (the scores on each response's last token, KL penalty included), response_mask
  [B, R], values [B, R] (the critic's);
- scores [B]: one number per sequence (the token rewards summed), index [B]: one prompt uid per sequence; all
  responses to a prompt must be in the same call (no cross-rank grouping);
- reward_baselines [B] (ReMax's greedy rollout's score), old_log_probs [B, R] and sum_pi_squared [B, R] (the
  actor's: log pi(token), sum over the vocabulary of pi^2), rollout_log_probs [B, R] (the rollout engine's).
Its keyword-only parameters are its knobs: a knob named like an `algorithm.*` config field gets that field.
Every estimator returns (advantages, returns), both (batch, response_length) and zero off the mask.
This module holds the registry, the shared group statistics and the classic estimators (GAE, REINFORCE++,
GRPO, RLOO); advantages_outcome.py the other outcome baselines, advantages_otb.py the optimal token baseline.
"""

import inspect

import torch

from verl_mega.algorithms.masked import check_same_shape, masked_whiten
from verl_mega.algorithms.registry import Registry
from verl_mega.ops import gae

ADV_ESTIMATORS = Registry("advantage estimator")
register_adv_est = ADV_ESTIMATORS.register
get_adv_estimator = ADV_ESTIMATORS.get


def estimator_inputs(name: str) -> tuple[str, ...]:
    """The inputs estimator `name` takes, by name (its positional parameters, in order)."""
    parameters = inspect.signature(get_adv_estimator(name)).parameters.values()
    return tuple(p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD)


def estimator_knobs(name: str) -> tuple[str, ...]:
    """The knobs estimator `name` takes, by name (its keyword-only parameters)."""
    parameters = inspect.signature(get_adv_estimator(name)).parameters.values()
    return tuple(p.name for p in parameters if p.kind is p.KEYWORD_ONLY)


@register_adv_est("gae")
def compute_gae_advantage_return(
    token_level_rewards, values, response_mask, *, gamma=1.0, lam=1.0, whiten=True
):
    """Generalised advantage estimation (Schulman et al. 2016); returns = advantages + values, before whitening."""
    check_same_shape("token_level_rewards", token_level_rewards, values=values, response_mask=response_mask)
    advantages, returns = gae(token_level_rewards, values, response_mask, gamma, lam)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages * response_mask, returns


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage_return(token_level_rewards, response_mask, *, gamma=1.0):
    """REINFORCE++ (Hu 2025): discounted return-to-go of the token rewards, whitened over the batch."""
    check_same_shape("token_level_rewards", token_level_rewards, response_mask=response_mask)
    returns = torch.zeros_like(token_level_rewards)
    running_return = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = running_return
        # A masked-out token (e.g. a tool observation) cuts the return, as in verl.
        running_return = running_return * response_mask[:, t]
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns * response_mask


def reward_to_go(token_level_rewards, response_mask):
    """The undiscounted return from each token on: the sum of the masked rewards at and after it."""
    return (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])


def prompt_groups(index, batch_size, device):
    """Map prompt uids (a sequence of hashables or a 1-D tensor) to group ids 0..G-1."""
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} entries, expected one per sequence ({batch_size})")
    if isinstance(index, torch.Tensor):
        return torch.unique(index, return_inverse=True)[1].to(device)
    group_of_uid = {}
    ids = [group_of_uid.setdefault(uid, len(group_of_uid)) for uid in index]
    return torch.tensor(ids, dtype=torch.long, device=device)


def group_stats(scores, index):
    """Per sequence: (size, mean, unbiased std) of its prompt group's scores."""
    group_ids = prompt_groups(index, scores.shape[0], scores.device)
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    zeros = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    sizes = zeros.index_add(0, group_ids, torch.ones_like(scores))
    sums = zeros.index_add(0, group_ids, scores)
    means = sums / sizes
    squared_errors = zeros.index_add(0, group_ids, (scores - means[group_ids]) ** 2)
    stds = (squared_errors / (sizes - 1).clamp_min(1)).sqrt()
    return sizes[group_ids], means[group_ids], stds[group_ids]


def check_outcome_inputs(scores, response_mask):
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (batch, response_length), got shape {tuple(response_mask.shape)}")
    if scores.shape != response_mask.shape[:1]:
        raise ValueError(
            f"scores has shape {tuple(scores.shape)}, expected ({response_mask.shape[0]},): one per sequence"
        )


def broadcast_to_tokens(seq_values, response_mask):
    return seq_values.unsqueeze(-1) * response_mask


# verl's *_vectorized estimators are the same math computed another way: one function here serves both names.
@register_adv_est("grpo", "grpo_vectorized")
def compute_grpo_outcome_advantage(scores, response_mask, index, *, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """GRPO (Shao et al. 2024): (score - group mean) / (group std + epsilon).

    A prompt with a single response gets mean 0 and std 1, as in verl. norm_adv_by_std_in_grpo=False is
    Dr. GRPO.
    """
    check_outcome_inputs(scores, response_mask)
    sizes, means, stds = group_stats(scores, index)
    singleton = sizes == 1
    advantages = scores - torch.where(singleton, 0.0, means)
    if norm_adv_by_std_in_grpo:
        advantages = advantages / (torch.where(singleton, 1.0, stds) + epsilon)
    advantages = broadcast_to_tokens(advantages, response_mask)
    return advantages, advantages


@register_adv_est("dr_grpo")
def compute_dr_grpo_outcome_advantage(scores, response_mask, index):
    """Dr. GRPO (Liu et al. 2025): score - group mean; the std division biases updates towards too-easy and
    too-hard prompts. (A function of its own, not GRPO's knob: norm_adv_by_std_in_grpo must not turn it back.)"""
    return compute_grpo_outcome_advantage(scores, response_mask, index, norm_adv_by_std_in_grpo=False)


@register_adv_est("rloo", "rloo_vectorized")
def compute_rloo_outcome_advantage(scores, response_mask, index):
    """RLOO (Ahmadian et al. 2024): score minus the mean score of the other responses to the same prompt."""
    check_outcome_inputs(scores, response_mask)
    sizes, means, _ = group_stats(scores, index)
    # score - (sum - score) / (n - 1) == (score - mean) * n / (n - 1); a lone response keeps its score.
    leave_one_out = (scores - means) * sizes / (sizes - 1).clamp_min(1)
    advantages = broadcast_to_tokens(torch.where(sizes == 1, scores, leave_one_out), response_mask)
    return advantages, advantages


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(scores, response_mask, index):
    """REINFORCE++-baseline: subtract the prompt group's mean score, then whiten over the batch's tokens."""
    check_outcome_inputs(scores, response_mask)
    sizes, means, _ = group_stats(scores, index)
    centred = broadcast_to_tokens(scores - torch.where(sizes == 1, 0.0, means), response_mask)
    advantages = masked_whiten(centred, response_mask) * response_mask
    return advantages, advantages
