"""PPO/GRPO math as pure tensor functions, with registries so configs can select estimators and losses by name."""

from verl_mega.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_advantage_return,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator,
    register_adv_est,
)
from verl_mega.algorithms.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl,
    get_kl_controller,
    get_kl_estimator,
    register_kl_estimator,
)
from verl_mega.algorithms.losses import (
    POLICY_LOSSES,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
    get_policy_loss_fn,
    register_policy_loss,
)
from verl_mega.algorithms.masked import (
    LOSS_AGG_MODES,
    agg_loss,
    agg_units,
    masked_mean,
    masked_sum,
    masked_sum_and_count,
    masked_var,
    masked_whiten,
)
from verl_mega.algorithms.normalize import RunningMeanStd
from verl_mega.algorithms.registry import Registry

__all__ = [
    "ADV_ESTIMATORS",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "Registry",
    "RunningMeanStd",
    "agg_loss",
    "agg_units",
    "apply_kl_penalty",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_kl",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_advantage_return",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator",
    "get_kl_controller",
    "get_kl_estimator",
    "get_policy_loss_fn",
    "masked_mean",
    "masked_sum",
    "masked_sum_and_count",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_kl_estimator",
    "register_policy_loss",
]
