"""Policy-gradient losses, registered under verl's names so a config written for verl selects the same math.

Every loss is `fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, rollout_is_weights=None,
**knobs) -> (pg_loss, metrics)`: [B, R] inputs, a scalar loss aggregated by `loss_agg_mode` (masked.LOSS_AGG_MODES)
and a dict of detached scalar metrics, each a token-level mean over the mask. `rollout_is_weights` ([B, R],
detached; None = 1) multiplies each token's policy-gradient loss before aggregation. The knobs are
PolicyLossConfig's fields, all passed to every loss (`PolicyLossConfig.knobs()`): each reads its own and ignores
the rest. The covariance-based losses (clip_cov, kl_cov) are in cov_losses.
"""

import torch

from verl_mega.algorithms.masked import agg_loss, check_same_shape, masked_mean
from verl_mega.algorithms.registry import Registry

POLICY_LOSSES = Registry("policy loss")
get_policy_loss_fn = POLICY_LOSSES.get

PPO_METRICS = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")

# Keep exp() finite when the policy has drifted far from the one that sampled the batch.
_MAX_LOG_RATIO = 20.0
# GSPO's sequence ratio is one number per sequence, exp'd on every token: verl bounds its log at 10.
_MAX_SEQUENCE_LOG_RATIO = 10.0


def register_policy_loss(*names: str, metrics: tuple[str, ...] = PPO_METRICS, old_from_rollout: bool = False):
    """Decorator registering a policy loss under `names`; `metrics` are the keys of the dict it returns (the
    actor needs them before the first micro-batch, on every pipeline stage). `old_from_rollout`: the loss takes
    the rollout engine's log-probs as its old log-probs (verl's bypass mode), so no old-log-prob pass runs."""

    def decorator(fn):
        fn.metric_names = metrics
        fn.old_from_rollout = old_from_rollout
        return POLICY_LOSSES.register(*names)(fn)

    return decorator


def policy_loss_metric_names(name: str) -> tuple[str, ...]:
    return get_policy_loss_fn(name).metric_names


def old_log_probs_from_rollout(name: str) -> bool:
    """Whether the policy loss `name` takes the rollout's log-probs as its old log-probs (bypass mode)."""
    return get_policy_loss_fn(name).old_from_rollout


def check_policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights) -> None:
    weights = {} if rollout_is_weights is None else {"rollout_is_weights": rollout_is_weights}
    check_same_shape("log_prob", log_prob, old_log_prob=old_log_prob, advantages=advantages,
                     response_mask=response_mask, **weights)


def clip_range(clip_ratio, clip_ratio_low, clip_ratio_high) -> tuple[float, float]:
    """(low, high): each side's clip range, clip_ratio where not given."""
    return (clip_ratio if clip_ratio_low is None else clip_ratio_low,
            clip_ratio if clip_ratio_high is None else clip_ratio_high)


def log_ratio(old_log_prob, log_prob):
    """log(pi / pi_old) per token, bounded so exp() stays finite."""
    return (log_prob - old_log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def clipped_surrogate(ratio, advantages, low, high):
    """PPO's max(-A r, -A clip(r, 1 - low, 1 + high)) per token, and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - low, 1 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def weighted(pg_losses, rollout_is_weights):
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def ppo_kl(token_log_ratio, response_mask):
    """The k1 estimate of KL(pi_old || pi) over the response tokens: mean(log pi_old - log pi)."""
    return masked_mean(-token_log_ratio, response_mask).detach()


@register_policy_loss("vanilla")
def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                        rollout_is_weights=None, clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                        clip_ratio_c=3.0, **_other_knobs):
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher) and dual-clip (Ye et al. 2020).

    The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high] (each defaults to clip_ratio). For
    negative advantages the loss is further capped at clip_ratio_c * |A|. Metrics: pg_clipfrac (the clip won),
    ppo_kl, pg_clipfrac_lower (the dual-clip cap won).
    """
    check_policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1.0, got {clip_ratio_c}")
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    token_log_ratio = log_ratio(old_log_prob, log_prob)
    ppo_losses, clipped = clipped_surrogate(token_log_ratio.exp(), advantages, low, high)

    # With A < 0 the max above grows without bound in the ratio; one stale, very unlikely token could
    # then dominate the update, so dual-clip caps it.
    dual_clip_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((ppo_losses > dual_clip_bound) & negative, response_mask)
    pg_losses = torch.where(negative, torch.minimum(ppo_losses, dual_clip_bound), ppo_losses)

    pg_loss = agg_loss(weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    return pg_loss, {"pg_clipfrac": masked_mean(clipped, response_mask).detach(),
                     "ppo_kl": ppo_kl(token_log_ratio, response_mask),
                     "pg_clipfrac_lower": pg_clipfrac_lower.detach()}


@register_policy_loss("gspo", metrics=("pg_clipfrac", "ppo_kl"))
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                             rollout_is_weights=None, clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                             **_other_knobs):
    """GSPO (Zheng et al. 2025, arXiv:2507.18071) in its token-level form, GSPO-token.

    The sequence ratio s_i = exp(mean_t log r_it), the length-normalised ratio of the whole response, is clipped
    to [1 - low, 1 + high] as PPO clips a token's. Each token carries s_it = sg[s_i] * pi_it / sg[pi_it]: its
    value is s_i and its gradient s_i * grad log pi_it, so every token of a response is weighted by the
    response's ratio and the response clips as one. The paper averages over responses
    (loss_agg_mode=seq-mean-token-mean, which verl's gspo uses whatever loss_agg_mode says; here the mode is
    honoured) and clips at 3e-4 / 4e-4. Metrics: pg_clipfrac, ppo_kl (token-level).
    """
    check_policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    token_log_ratio = log_ratio(old_log_prob, log_prob)
    sequence_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1).to(log_prob.dtype)
    # Stop-gradient form: the value is log s_i, the gradient that of log pi_it alone.
    gspo_log_ratio = log_prob - log_prob.detach() + sequence_log_ratio.detach()[:, None]
    ratio = gspo_log_ratio.clamp(max=_MAX_SEQUENCE_LOG_RATIO).exp()
    pg_losses, clipped = clipped_surrogate(ratio, advantages, low, high)
    pg_loss = agg_loss(weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    return pg_loss, {"pg_clipfrac": masked_mean(clipped, response_mask).detach(),
                     "ppo_kl": ppo_kl(token_log_ratio, response_mask)}


@register_policy_loss("cispo", metrics=("pg_clipfrac", "ppo_kl"))
def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                              rollout_is_weights=None, clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                              **_other_knobs):
    """CISPO (MiniMax-M1, arXiv:2506.13585): REINFORCE weighted by the clipped importance ratio, no gradient
    through it: loss = -sg[clip(r, 1 - low, 1 + high)] * A * log pi.

    Unlike PPO's clip, which zeroes a clipped token's gradient, every token keeps one (bounded by the clip):
    tokens whose ratio leaves the range still learn, at the range's weight. Metrics: pg_clipfrac (the weight was
    clipped), ppo_kl.
    """
    check_policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    token_log_ratio = log_ratio(old_log_prob, log_prob)
    ratio = token_log_ratio.exp()
    weight = ratio.clamp(1 - low, 1 + high).detach()
    pg_losses = -weight * advantages * log_prob
    pg_loss = agg_loss(weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    return pg_loss, {"pg_clipfrac": masked_mean((ratio < 1 - low) | (ratio > 1 + high), response_mask).detach(),
                     "ppo_kl": ppo_kl(token_log_ratio, response_mask)}


@register_policy_loss("geo_mean", "gmpo")
def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                                 rollout_is_weights=None, clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                                 **_other_knobs):
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of the token ratios instead of their sum.

    Each token's log-ratio is clipped in log space to [-low, high] on the side its advantage pushes (the
    pessimistic min, as PPO's), then response i's loss is -A_i * exp(mean_t clipped log r_it), A_i the mean of
    its tokens' advantages (a sequence-level advantage). That loss is put on each of its tokens, so
    loss_agg_mode=seq-mean-token-mean gives the paper's mean over responses (verl's geo_mean always averages
    over rows). The paper clips at 0.4. `rollout_is_weights` enter as each response's geometric mean, as verl
    does. Metrics: pg_clipfrac (a log-ratio clipped where A > 0), pg_clipfrac_lower (where A < 0), ppo_kl.
    """
    check_policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    token_log_ratio = log_ratio(old_log_prob, log_prob)
    clamped = token_log_ratio.clamp(-low, high)
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * token_log_ratio, sign * clamped)
    sequence_ratio = masked_mean(pessimistic, response_mask, dim=-1).exp()
    sequence_advantage = masked_mean(advantages, response_mask, dim=-1)
    sequence_losses = -sequence_advantage * sequence_ratio
    if rollout_is_weights is not None:
        sequence_losses = sequence_losses * masked_mean((rollout_is_weights + 1e-10).log(), response_mask, dim=-1).exp()
    pg_losses = sequence_losses[:, None].expand_as(advantages)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    was_clipped = token_log_ratio != clamped
    return pg_loss, {"pg_clipfrac": masked_mean(was_clipped & (advantages > 0), response_mask).detach(),
                     "ppo_kl": ppo_kl(token_log_ratio, response_mask),
                     "pg_clipfrac_lower": masked_mean(was_clipped & (advantages < 0), response_mask).detach()}


@register_policy_loss("sapo", metrics=("ppo_kl",))
def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                             rollout_is_weights=None, tau_pos=1.0, tau_neg=1.05, **_other_knobs):
    """SAPO (Qwen, arXiv:2511.20347): a soft, temperature-controlled gate instead of a hard clip.

    loss = -f(r) * A with f(r) = sigmoid(tau * (r - 1)) * 4 / tau, tau = tau_pos where A > 0 and tau_neg
    elsewhere. At r = 1 the gradient is exactly REINFORCE's (f'(1) r = 1); away from it the gate's slope decays
    smoothly, faster for larger tau, so a larger tau_neg damps negative updates sooner. The paper averages over
    responses (loss_agg_mode=seq-mean-token-mean, which verl's sapo uses whatever loss_agg_mode says; here the
    mode is honoured). Metrics: ppo_kl.
    """
    check_policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be positive, got {tau_pos} and {tau_neg}")
    token_log_ratio = log_ratio(old_log_prob, log_prob)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(log_prob.dtype)
    gate = torch.sigmoid(tau * (token_log_ratio.exp() - 1)) * 4 / tau
    pg_losses = -gate * advantages
    pg_loss = agg_loss(weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    return pg_loss, {"ppo_kl": ppo_kl(token_log_ratio, response_mask)}


@register_policy_loss("gpg", metrics=("ppo_kl",))
def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                            rollout_is_weights=None, **_other_knobs):
    """GPG (Chu et al. 2025, arXiv:2504.02546): the plain policy gradient, loss = -A * log pi, no ratio and no
    clip (old_log_prob enters only the ppo_kl metric). For one update per batch (on-policy)."""
    check_policy_loss_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    pg_losses = -advantages * log_prob
    pg_loss = agg_loss(weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    return pg_loss, {"ppo_kl": ppo_kl(log_ratio(old_log_prob, log_prob), response_mask)}


BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


@register_policy_loss("bypass_mode", old_from_rollout=True)
def compute_policy_loss_bypass_mode(old_log_prob, log_prob, advantages, response_mask, *,
                                    loss_agg_mode="token-mean", rollout_is_weights=None,
                                    bypass_loss_type="ppo_clip", **knobs):
    """verl's bypass mode: `old_log_prob` is the rollout engine's log-prob (the actor passes rollout_log_probs),
    so the update needs no old-log-prob pass, on-policy or not.

    - ppo_clip: PPO's clipped surrogate (vanilla) on the ratio pi / pi_rollout: the ratio is the importance
      correction and the clip bounds it, so `rollout_is_weights` should carry only a rejection's zeros (the
      actor passes no truncated weights: they would count the correction twice).
    - reinforce: -w * A * log pi (gpg), w = `rollout_is_weights`, the truncated pi / pi_rollout the actor
      computes from algorithm.rollout_correction (None: plain REINFORCE). Its clip fractions are 0.
    """
    if bypass_loss_type == "ppo_clip":
        return compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
                                   rollout_is_weights=rollout_is_weights, **knobs)
    if bypass_loss_type != "reinforce":
        raise ValueError(f"bypass_loss_type must be one of {', '.join(BYPASS_LOSS_TYPES)}, got {bypass_loss_type!r}")
    pg_loss, metrics = compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask,
                                               loss_agg_mode=loss_agg_mode, rollout_is_weights=rollout_is_weights)
    never = torch.zeros((), dtype=metrics["ppo_kl"].dtype, device=log_prob.device)
    return pg_loss, {"pg_clipfrac": never, "ppo_kl": metrics["ppo_kl"], "pg_clipfrac_lower": never}
