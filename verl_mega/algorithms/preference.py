"""Preference-optimisation losses as pure tensor functions of per-sequence summed log-probs.

Paired losses (DPO, IPO, SimPO, ORPO) take a chosen and a rejected completion per prompt; KTO takes single
completions labelled desirable or not. Every function returns per-example losses and implicit rewards (no
reduction), so the caller weights them by its share of the global batch and the update does not depend on
how the batch is split over ranks and micro-batches. Log-probs are summed over each completion's tokens;
`*_tokens` are the completion lengths, which the length-normalised losses (SimPO, ORPO) divide by.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from verl_mega.algorithms.registry import Registry

PREFERENCE_LOSSES = Registry("preference loss")
# Losses of single completions with a desirable/undesirable label instead of chosen/rejected pairs.
UNPAIRED_LOSSES = frozenset({"kto"})
# Losses that compare against the policy itself (length-normalised log-probs), so no reference model runs.
REFERENCE_FREE_LOSSES = frozenset({"simpo", "orpo"})


class PairLogps(NamedTuple):
    """[N] per pair: summed log-probs of the chosen and rejected completions under the policy and the
    reference (None for reference-free losses), and the completions' token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


class PairLoss(NamedTuple):
    """[N] per pair: the loss, and the implicit rewards of the chosen and rejected completions (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def get_preference_loss_fn(name: str):
    return PREFERENCE_LOSSES.get(name)


def _smoothed_sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    # cDPO (Mitchell 2023): the preference label is flipped with probability `label_smoothing`.
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def _reference_log_ratios(logps: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
    if logps.ref_chosen is None or logps.ref_rejected is None:
        raise ValueError("this preference loss needs the reference model's log-probs (ref_chosen, ref_rejected)")
    return logps.chosen - logps.ref_chosen, logps.rejected - logps.ref_rejected


def _length_normalised(logps: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
    return logps.chosen / logps.chosen_tokens.clamp_min(1), logps.rejected / logps.rejected_tokens.clamp_min(1)


@PREFERENCE_LOSSES.register("dpo")
def dpo_loss(logps: PairLogps, beta: float = 0.1, label_smoothing: float = 0.0, **_) -> PairLoss:
    """DPO (Rafailov et al. 2023, eq. 7): -log σ(β[(π_c - ref_c) - (π_r - ref_r)]), with cDPO label smoothing."""
    chosen_ratio, rejected_ratio = _reference_log_ratios(logps)
    losses = _smoothed_sigmoid_loss(beta * (chosen_ratio - rejected_ratio), label_smoothing)
    return PairLoss(losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach())


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(logps: PairLogps, beta: float = 0.1, **_) -> PairLoss:
    """IPO (Azar et al. 2023, eq. 17): ((π_c - ref_c) - (π_r - ref_r) - 1/(2β))², on summed log-probs as in
    the paper; β is its regularisation τ."""
    chosen_ratio, rejected_ratio = _reference_log_ratios(logps)
    losses = (chosen_ratio - rejected_ratio - 1 / (2 * beta)) ** 2
    return PairLoss(losses, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach())


@PREFERENCE_LOSSES.register("simpo")
def simpo_loss(logps: PairLogps, beta: float = 2.0, gamma: float = 0.5, label_smoothing: float = 0.0,
               **_) -> PairLoss:
    """SimPO (Meng et al. 2024, eq. 6): -log σ(β(π_c/|c| - π_r/|r|) - γ); rewards β·π/|y|, no reference."""
    chosen_mean, rejected_mean = _length_normalised(logps)
    losses = _smoothed_sigmoid_loss(beta * (chosen_mean - rejected_mean) - gamma, label_smoothing)
    return PairLoss(losses, (beta * chosen_mean).detach(), (beta * rejected_mean).detach())


@PREFERENCE_LOSSES.register("orpo")
def orpo_loss(logps: PairLogps, beta: float = 0.1, **_) -> PairLoss:
    """ORPO (Hong et al. 2024, eqs. 6-7): NLL of the chosen completion (per token) - β·log σ(log odds ratio),
    odds(y) = P/(1-P) with P = exp(π/|y|) the per-token likelihood; β is the paper's λ. Rewards β·π/|y|."""
    chosen_mean, rejected_mean = _length_normalised(logps)
    # log(1 - exp(x)) through expm1: exact as x -> 0-, where 1 - exp(x) cancels.
    log_odds = (chosen_mean - rejected_mean) - (torch.log(-torch.expm1(chosen_mean))
                                                - torch.log(-torch.expm1(rejected_mean)))
    losses = -chosen_mean - beta * F.logsigmoid(log_odds)
    return PairLoss(losses, (beta * chosen_mean).detach(), (beta * rejected_mean).detach())


def pair_metrics(logps: PairLogps, loss: PairLoss) -> dict[str, torch.Tensor]:
    """[N] per pair: what preference runs log (averaged over pairs by the caller)."""
    return {"loss": loss.losses.detach(), "rewards/chosen": loss.chosen_rewards,
            "rewards/rejected": loss.rejected_rewards, "rewards/margins": loss.chosen_rewards - loss.rejected_rewards,
            "rewards/accuracy": (loss.chosen_rewards > loss.rejected_rewards).to(loss.losses.dtype),
            "logps/chosen": logps.chosen.detach(), "logps/rejected": logps.rejected.detach()}


def kto_kl_baseline(policy_mismatched_logps: torch.Tensor, ref_mismatched_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point z₀ (Ethayarajh et al. 2024, §4.1): the batch estimate of KL(π‖ref), from completions
    paired with other rows' prompts, clamped at 0 and detached (it is a baseline, not a training signal).
    Pass the whole global batch's log-probs so every rank and micro-batch uses the same z₀."""
    return (policy_mismatched_logps - ref_mismatched_logps).mean().clamp_min(0).detach()


@PREFERENCE_LOSSES.register("kto")
def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl_baseline: torch.Tensor,
             beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             **_) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO (Ethayarajh et al. 2024, eq. 8) over [N] single completions: with r = π - ref,
    desirable: λ_D(1 - σ(β(r - z₀))), undesirable: λ_U(1 - σ(β(z₀ - r))). Returns (losses, rewards β·r)."""
    log_ratio = policy_logps - ref_logps
    desirable = desirable.bool()
    value = torch.where(desirable, torch.sigmoid(beta * (log_ratio - kl_baseline)),
                        torch.sigmoid(beta * (kl_baseline - log_ratio)))
    weight = torch.where(desirable, torch.full_like(log_ratio, desirable_weight),
                         torch.full_like(log_ratio, undesirable_weight))
    return weight * (1 - value), (beta * log_ratio).detach()
