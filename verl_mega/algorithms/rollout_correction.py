"""Rollout/training mismatch as pure tensor functions: the per-token ratio π_train/π_rollout, the metrics that
measure it, and the corrections that act on it (truncated importance weights, rejection masks).

`train_log_prob` is the trainer's log-prob of a response token (the old-log-prob pass's, or the on-policy
update's first forward's, detached), `rollout_log_prob` the rollout engine's for the same token, both on
logits / temperature; all tensors are [B, R] with the response mask's zeros at padding. A correction works at
one of three levels of a ratio: `token` (each token's own), `sequence` (the product over its response: the
likelihood ratio of the whole sequence) or `geometric` (the geometric mean over its response, the product's
length-normalised form), the last two shared by every token of the row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from verl_mega.algorithms.masked import check_same_shape, masked_mean

LEVELS = ("token", "sequence", "geometric")
CORRECTION_OFF = "none"  # not "off": YAML reads an unquoted off as false
# What `algorithm.rollout_correction.weights` and `.reject` take.
CORRECTION_MODES = (CORRECTION_OFF, *LEVELS)
# exp() of a log ratio stays finite (e^20 ~ 5e8): a sequence's log ratio sums hundreds of token log ratios.
MAX_LOG_RATIO = 20.0


def token_log_ratio(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                    response_mask: torch.Tensor) -> torch.Tensor:
    """log(π_train / π_rollout) per token, 0 at padding, bounded to ±MAX_LOG_RATIO."""
    check_same_shape("train_log_prob", train_log_prob, rollout_log_prob=rollout_log_prob,
                     response_mask=response_mask)
    dtype = torch.promote_types(torch.float32, response_mask.dtype)
    difference = (train_log_prob.to(dtype) - rollout_log_prob.to(dtype)) * response_mask
    return difference.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def level_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log ratio at `level` (see the module), for every token [B, R]: its own (token), its row's sum
    (sequence) or its row's mean over the response tokens (geometric), bounded to ±MAX_LOG_RATIO."""
    if level == "token":
        return log_ratio
    if level not in LEVELS:
        raise ValueError(f"unknown rollout-correction level {level!r}; known: {', '.join(LEVELS)}")
    row = (log_ratio * response_mask).sum(dim=-1, keepdim=True)
    if level == "geometric":
        row = row / response_mask.sum(dim=-1, keepdim=True).clamp_min(1)
    return row.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).expand_as(log_ratio)


def truncated_is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, cap: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights min(ratio, cap) at `level` [B, R], 0 at padding, and which response
    tokens' weight the cap truncated (bool)."""
    ratio = level_log_ratio(log_ratio, response_mask, level).exp()
    truncated = (ratio > cap) & response_mask.bool()
    return ratio.clamp(max=cap) * response_mask, truncated


def rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, low: float, high: float
                   ) -> torch.Tensor:
    """The response mask without the tokens whose ratio at `level` leaves [low, high] (at `sequence` or
    `geometric` level, whole rows go)."""
    ratio = level_log_ratio(log_ratio, response_mask, level).exp()
    return response_mask * ((ratio >= low) & (ratio <= high)).to(response_mask.dtype)


@dataclass(frozen=True)
class Correction:
    """What a rollout correction does to a batch of responses."""

    # [B, R] detached, multiplying each token's policy-gradient loss (`rollout_is_weights`): the truncated
    # importance weight (1 without weights), 0 where rejected; None where neither is on
    loss_weights: torch.Tensor | None
    truncated: torch.Tensor  # [B, R] bool: response tokens whose weight the cap truncated
    rejected: torch.Tensor  # [B, R] bool: response tokens the rejection took out of the loss


def rollout_correction(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       *, weights: str = CORRECTION_OFF, weight_cap: float = 2.0, reject: str = CORRECTION_OFF,
                       reject_low: float = 0.5, reject_high: float = 2.0) -> Correction:
    """The importance weights at level `weights` truncated at `weight_cap`, and the rejection at level `reject`
    outside [reject_low, reject_high], each from the same per-token ratios; `none` turns either off.

    A rejected token's policy-gradient loss is weighted 0 while the loss aggregation still counts it (a zero in
    the mean, as IcePop and slime's masks do): the mean's units then do not depend on the ratios, so a
    micro-batch's share of its mini-batch, counted from the response mask, stays right at every layout."""
    log_ratio = token_log_ratio(train_log_prob, rollout_log_prob, response_mask).detach()
    in_response = response_mask.bool()
    loss_weights, truncated, rejected = None, torch.zeros_like(in_response), torch.zeros_like(in_response)
    if weights != CORRECTION_OFF:
        loss_weights, truncated = truncated_is_weights(log_ratio, response_mask, weights, weight_cap)
    if reject != CORRECTION_OFF:
        kept = rejection_mask(log_ratio, response_mask, reject, reject_low, reject_high).to(log_ratio.dtype)
        rejected = in_response & (kept == 0)
        loss_weights = kept if loss_weights is None else loss_weights * kept
    return Correction(loss_weights, truncated, rejected)


def mismatch_metrics(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                     correction: Correction) -> dict[str, float]:
    """How far the rollout's distribution is from the trainer's on these response tokens (sampled from the
    rollout's), and what `correction` did to them:

    - kl_k1, kl_k3: KL(rollout ‖ training) estimated per token as log(π_r/π_t) (k1: unbiased, noisy, may be
      negative) and as ρ - 1 - log ρ with ρ = π_t/π_r (k3: unbiased, never negative), means over the tokens;
    - log_ppl_diff: the mean over responses of log-perplexity under training minus under the rollout (each the
      response's mean token NLL); > 0: the trainer finds the samples less likely than the engine did;
    - ratio_mean / ratio_min / ratio_max: of ρ over the tokens;
    - is_truncated_frac, rejected_frac: the share of the tokens whose weight was truncated / that were masked.
    """
    # float64: at fp32 rounding distances (log ratios ~1e-7) ρ - 1 - log ρ would cancel to 0 in float32.
    mask = response_mask.double()
    log_ratio = token_log_ratio(train_log_prob, rollout_log_prob, mask).double()
    ratio = log_ratio.exp()
    in_response = mask.bool()
    tokens_per_row = mask.sum(dim=-1)
    with_tokens = tokens_per_row > 0
    row_log_ppl_diff = -(log_ratio * mask).sum(dim=-1) / tokens_per_row.clamp_min(1)
    return {
        "kl_k1": masked_mean(-log_ratio, mask).item(),
        "kl_k3": masked_mean(torch.expm1(log_ratio) - log_ratio, mask).item(),
        "log_ppl_diff": row_log_ppl_diff[with_tokens].mean().item() if with_tokens.any() else 0.0,
        "ratio_mean": masked_mean(ratio, mask).item(),
        "ratio_min": ratio[in_response].min().item() if in_response.any() else 1.0,
        "ratio_max": ratio[in_response].max().item() if in_response.any() else 1.0,
        "is_truncated_frac": masked_mean(correction.truncated.float(), mask).item(),
        "rejected_frac": masked_mean(correction.rejected.float(), mask).item(),
    }


def mismatch_metrics_by_source(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                               response_mask: torch.Tensor, correction: Correction,
                               sources: Sequence[str | None]) -> dict[str, float]:
    """`mismatch_metrics` over all rows, named `<metric>`, and over the rows of each of `sources` (one per row,
    None: none), named `<metric>/<source>`."""
    metrics = mismatch_metrics(train_log_prob, rollout_log_prob, response_mask, correction)
    for source in sorted({source for source in sources if source is not None}):
        rows = torch.tensor([row for row, name in enumerate(sources) if name == source])
        part = Correction(None, correction.truncated[rows], correction.rejected[rows])
        for name, value in mismatch_metrics(train_log_prob[rows], rollout_log_prob[rows], response_mask[rows],
                                            part).items():
            metrics[f"{name}/{source}"] = value
    return metrics
