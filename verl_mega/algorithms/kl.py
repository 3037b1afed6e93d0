"""KL estimators (Schulman's k1/k2/k3), KL-in-reward penalty, and KL coefficient controllers."""

import torch

from verl_mega.algorithms.masked import check_same_shape, masked_mean
from verl_mega.algorithms.registry import Registry
from verl_mega.files.plain_state import number

KL_ESTIMATORS = Registry("KL estimator")
register_kl_estimator = KL_ESTIMATORS.register
get_kl_estimator = KL_ESTIMATORS.get

# Keep exp() finite in k3 when the policies have drifted far apart.
_MAX_LOG_RATIO = 20.0
# verl's clamp on k3: one badly-off token must not dominate the penalty.
_MAX_LOW_VAR_KL = 10.0


@register_kl_estimator("k1", "kl")
def kl_k1(log_prob, ref_log_prob):
    """log p - log p_ref: unbiased, but high variance and can be negative per token."""
    return log_prob - ref_log_prob


@register_kl_estimator("abs")
def kl_abs(log_prob, ref_log_prob):
    return (log_prob - ref_log_prob).abs()


@register_kl_estimator("k2", "mse")
def kl_k2(log_prob, ref_log_prob):
    """0.5 * (log p - log p_ref)^2."""
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_estimator("k3", "low_var_kl")
def kl_k3(log_prob, ref_log_prob):
    """exp(r) - r - 1 with r = log p_ref - log p: unbiased, never negative, low variance."""
    log_ratio = (ref_log_prob - log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (log_ratio.exp() - log_ratio - 1).clamp(-_MAX_LOW_VAR_KL, _MAX_LOW_VAR_KL)


def compute_kl(log_prob, ref_log_prob, estimator="k1"):
    """Token-level KL(pi || pi_ref) estimate by estimator name (see KL_ESTIMATORS)."""
    check_same_shape("log_prob", log_prob, ref_log_prob=ref_log_prob)
    return get_kl_estimator(estimator)(log_prob, ref_log_prob)


def apply_kl_penalty(
    token_level_scores, old_log_prob, ref_log_prob, response_mask, *, kl_coef, estimator="k1", group=None
):
    """KL in reward: token_level_rewards = token_level_scores - kl_coef * KL.

    Returns (token_level_rewards, current_kl), current_kl being the batch mean of each sequence's mean KL
    (over `group` when given, so every rank feeds its controller the same number).
    """
    check_same_shape(
        "token_level_scores", token_level_scores,
        old_log_prob=old_log_prob, ref_log_prob=ref_log_prob, response_mask=response_mask,
    )
    kl = compute_kl(old_log_prob, ref_log_prob, estimator) * response_mask
    token_level_rewards = token_level_scores - kl_coef * kl
    seq_kl = masked_mean(kl, response_mask, dim=-1)
    current_kl = masked_mean(seq_kl, torch.ones_like(seq_kl), group=group)
    return token_level_rewards, current_kl.detach()


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; present so trainers can treat both controllers alike."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """The coefficient `state_dict` saved: a finite number >= 0, else a ValueError naming `kl_ctrl.value`."""
        self.value = number(state, "value", "kl_ctrl", low=0)


class AdaptiveKLController(FixedKLController):
    """Adaptive KL coefficient (Ziegler et al. 2019): steers the observed KL towards target_kl."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be positive, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon}")
        super().__init__(init_kl_coef)
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        # Clipping the error bounds how far one noisy batch can move the coefficient.
        proportional_error = min(max(float(current_kl) / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


KL_CONTROLLERS = ("adaptive", "fixed")


def get_kl_controller(kl_ctrl_type: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None):
    """Build the controller named by kl_ctrl_type ("fixed" or "adaptive")."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("the adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl_type {kl_ctrl_type!r}; known: {', '.join(KL_CONTROLLERS)}")
