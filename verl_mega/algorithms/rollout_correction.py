"""Rollout/training mismatch as pure tensor functions: the per-token ratio ρ = π_train/π_rollout, the metrics
that measure it, and the corrections that act on it (truncated importance weights, rejection masks), with verl's
semantics under verl's names (`algorithm.rollout_correction`, docs/rollout-correction.md).

`train_log_prob` is the trainer's log-prob of a response token (the old-log-prob pass's, or the on-policy
update's first forward's, detached), `rollout_log_prob` the rollout engine's for the same token, both on
logits / temperature; all tensors are [B, R] with the response mask's zeros at padding.

- Importance weights (verl's `rollout_is`) work at one of three levels of ρ: `token` (each token's own),
  `sequence` (the product over its response: the likelihood ratio of the whole sequence) or `geometric` (their
  geometric mean, the product's length-normalised form; not in verl), the last two shared by every token of the
  row. Each weight is truncated at `rollout_is_threshold` and, on request, divided by the batch's mean weight.
- Rejection (verl's `rollout_rs`) is a list of options `<aggregation>_<divergence>`, all of which a token must
  pass: a per-token divergence of log ρ (k1 = -log ρ, k2 = ½ (log ρ)², k3 = ρ - 1 - log ρ) taken per token or
  summed, averaged or maximised over the response. A k1 option keeps log(lower) <= k1 <= log(upper) for its
  threshold `lower_upper` (so ρ itself, or its product or geometric mean, stays in [1/upper, 1/lower]); a k2 or
  k3 option keeps the divergence <= its threshold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from verl_mega.algorithms.masked import check_same_shape, masked_mean, masked_sum
from verl_mega.algorithms.registry import Registry

IS_LEVELS = ("token", "sequence", "geometric")
# exp() of a log ratio stays finite (e^20 ~ 5e8): a sequence's log ratio sums hundreds of token log ratios.
MAX_LOG_RATIO = 20.0
# Below it a batch's mean weight is taken as no mean at all: the weights are left as they are (as verl does).
_MIN_BATCH_MEAN = 1e-8

DIVERGENCES = Registry("rejection divergence")
AGGREGATIONS = Registry("rejection aggregation")


@DIVERGENCES.register("k1")
def k1_divergence(log_ratio: torch.Tensor) -> torch.Tensor:
    """log(π_rollout/π_train): the k1 estimator of KL(rollout ‖ training), signed."""
    return -log_ratio


@DIVERGENCES.register("k2")
def k2_divergence(log_ratio: torch.Tensor) -> torch.Tensor:
    """½ (log ρ)², never negative."""
    return 0.5 * log_ratio.square()


@DIVERGENCES.register("k3")
def k3_divergence(log_ratio: torch.Tensor) -> torch.Tensor:
    """ρ - 1 - log ρ, never negative (expm1 keeps it exact near ρ = 1)."""
    return torch.expm1(log_ratio) - log_ratio


@AGGREGATIONS.register("token")
def per_token(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return values


@AGGREGATIONS.register("seq_sum")
def row_sum(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(values, response_mask, dim=-1).unsqueeze(-1).expand_as(values)


@AGGREGATIONS.register("seq_mean")
def row_mean(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(values, response_mask, dim=-1).unsqueeze(-1).expand_as(values)


@AGGREGATIONS.register("seq_max")
def row_max(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The row's largest value over its response tokens (0 for a row without any)."""
    largest = values.masked_fill(~response_mask.bool(), -math.inf).max(dim=-1, keepdim=True).values
    return torch.where(largest.isinf(), torch.zeros_like(largest), largest).expand_as(values)


# verl's options: every aggregation of every divergence except the max of k1, which is signed (a max of it bounds
# only one side).
RS_OPTIONS = tuple(f"{aggregation}_{divergence}" for aggregation in AGGREGATIONS.names()
                   for divergence in DIVERGENCES.names() if (aggregation, divergence) != ("seq_max", "k1"))


@dataclass(frozen=True)
class RejectionBound:
    """One `rollout_rs` option and the band its statistic must stay in (k1: log(lower) to log(upper))."""

    option: str
    lower: float | None  # k1 only, on the ratio scale
    upper: float

    @property
    def divergence(self) -> str:
        return self.option.rpartition("_")[2]

    @property
    def aggregation(self) -> str:
        return self.option.rpartition("_")[0]


def parse_rejection(rollout_rs: str, rollout_rs_threshold: str | float | None) -> list[RejectionBound]:
    """verl's `rollout_rs` ("token_k1,seq_max_k3": options all of which must pass, duplicates dropped) with its
    `rollout_rs_threshold`: one entry shared by all options or one per option, comma-separated; a k1 entry is
    `lower_upper` on the ratio scale, or one number, the upper, with lower = 1/upper; a k2/k3 entry is the
    largest divergence kept. ValueError on anything else."""
    options = list(dict.fromkeys(part.strip() for part in str(rollout_rs).split(",") if part.strip()))
    unknown = [option for option in options if option not in RS_OPTIONS]
    if not options or unknown:
        raise ValueError(f"rollout_rs {rollout_rs!r}: {unknown[0] if unknown else 'no option'} is not one of "
                         f"{', '.join(RS_OPTIONS)}")
    if rollout_rs_threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs} needs rollout_rs_threshold")
    specs = [part.strip() for part in str(rollout_rs_threshold).split(",") if part.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold {rollout_rs_threshold!r} holds {len(specs)} entries for "
                         f"{len(options)} rollout_rs options: give one, or one per option")
    specs = specs * len(options) if len(specs) == 1 else specs
    return [_bound(option, spec) for option, spec in zip(options, specs)]


def _bound(option: str, spec: str) -> RejectionBound:
    if "_" in spec and not option.endswith("k1"):
        raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: only k1 options take lower_upper; "
                         "k2 and k3 take one upper bound")
    lower_text, _, upper_text = spec.rpartition("_")
    try:
        upper = float(upper_text)
        lower = float(lower_text) if lower_text else 1.0 / upper if option.endswith("k1") else None
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"rollout_rs_threshold {spec!r} for {option} is not a positive number"
                         f"{' or lower_upper' if option.endswith('k1') else ''}") from None
    if upper <= 0 or (lower is not None and lower <= 0) or math.isnan(upper):
        raise ValueError(f"rollout_rs_threshold {spec!r} for {option} must be positive")
    return RejectionBound(option, lower, upper)


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
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {level!r}; known: {', '.join(IS_LEVELS)}")
    row = row_mean if level == "geometric" else row_sum
    return row(log_ratio, response_mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """The untruncated importance weights at `level` [B, R], 0 at padding."""
    return level_log_ratio(log_ratio, response_mask, level).exp() * response_mask


def is_batch_mean(weights: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """The batch's mean weight (verl's rollout_is_batch_normalize): over the tokens at `token` level, over the
    responses (one weight each) at `sequence` and `geometric` level."""
    if level == "token":
        return masked_mean(weights, response_mask)
    rows = response_mask.sum(dim=-1) > 0
    return masked_mean(weights, response_mask, dim=-1)[rows].mean() if rows.any() else weights.new_zeros(())


def batch_normalized(weights: torch.Tensor, mean: torch.Tensor | float) -> torch.Tensor:
    """`weights` / `mean`, or `weights` as they are where the mean is ~0 (nothing to divide by)."""
    return weights / mean if float(mean) > _MIN_BATCH_MEAN else weights


def rejection_statistic(log_ratio: torch.Tensor, response_mask: torch.Tensor, bound: RejectionBound) -> torch.Tensor:
    """[B, R]: `bound`'s option's divergence per token, or its row's aggregate repeated on each token."""
    return AGGREGATIONS.get(bound.aggregation)(DIVERGENCES.get(bound.divergence)(log_ratio), response_mask)


def rejection_keeps(log_ratio: torch.Tensor, response_mask: torch.Tensor, bound: RejectionBound) -> torch.Tensor:
    """Which tokens (bool [B, R]) `bound`'s option keeps: its statistic inside the band (a row statistic keeps
    or drops the whole row)."""
    statistic = rejection_statistic(log_ratio, response_mask, bound)
    low, high = band(bound)
    return statistic <= high if bound.lower is None else (statistic >= low) & (statistic <= high)


def band(bound: RejectionBound) -> tuple[float, float]:
    """The statistic's band: k1's on the log scale; k2 and k3 from 0 (they are never negative)."""
    if bound.lower is None:
        return 0.0, bound.upper
    return math.log(bound.lower), math.log(bound.upper)


@dataclass(frozen=True)
class Correction:
    """What a rollout correction does to a batch of responses, and what its metrics need."""

    # [B, R] detached, multiplying each token's policy-gradient loss (`rollout_is_weights`): the truncated
    # (and batch-normalised) importance weight (1 without weights), 0 where rejected; None where neither is on
    loss_weights: torch.Tensor | None
    truncated: torch.Tensor  # [B, R] bool: response tokens whose weight the cap truncated
    rejected: torch.Tensor  # [B, R] bool: response tokens the rejection took out of the loss
    # [B, R] the untruncated weights at the configured level (None without weights), their level and cap
    raw_weights: torch.Tensor | None = None
    level: str | None = None
    cap: float = math.inf
    batch_mean: float | None = None  # the divisor of rollout_is_batch_normalize, where it is on
    # option -> [B, R] bool: response tokens that option rejected
    rejected_by: dict[str, torch.Tensor] = field(default_factory=dict)
    bounds: tuple[RejectionBound, ...] = ()  # the rejection's options, in the order given

    def rows(self, rows: torch.Tensor) -> "Correction":
        """The same correction restricted to `rows` (for per-data-source metrics)."""
        pick = lambda tensor: None if tensor is None else tensor[rows]  # noqa: E731
        return replace(self, loss_weights=pick(self.loss_weights), truncated=self.truncated[rows],
                       rejected=self.rejected[rows], raw_weights=pick(self.raw_weights),
                       rejected_by={option: mask[rows] for option, mask in self.rejected_by.items()})


def rollout_correction(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       *, rollout_is: str | None = None, rollout_is_threshold: float = 2.0,
                       rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
                       rollout_rs_threshold: str | float | None = None,
                       batch_mean: torch.Tensor | float | None = None) -> Correction:
    """verl's rollout correction under its keys (see the module): weights at level `rollout_is` truncated at
    `rollout_is_threshold` (then divided by their batch mean with `rollout_is_batch_normalize`: `batch_mean` where
    given, the batch being larger than these rows, else these rows' mean), and the rejection `rollout_rs`; None
    turns either off.

    A rejected token's policy-gradient loss is weighted 0 while the loss aggregation still counts it (a zero in
    the mean, as IcePop and slime's masks do; verl drops it from the mean's count): the mean's units then do not
    depend on the ratios, so a micro-batch's share of its mini-batch, counted from the response mask, stays right
    at every layout."""
    log_ratio = token_log_ratio(train_log_prob, rollout_log_prob, response_mask).detach()
    in_response = response_mask.bool()
    correction = Correction(None, torch.zeros_like(in_response), torch.zeros_like(in_response))
    if rollout_is is not None:
        raw = is_weights(log_ratio, response_mask, rollout_is)
        weights = raw.clamp(max=rollout_is_threshold)
        if rollout_is_batch_normalize:
            batch_mean = is_batch_mean(weights, response_mask, rollout_is) if batch_mean is None else batch_mean
            weights = batch_normalized(weights, batch_mean)
        correction = replace(correction, loss_weights=weights, truncated=(raw > rollout_is_threshold) & in_response,
                             raw_weights=raw, level=rollout_is, cap=rollout_is_threshold,
                             batch_mean=float(batch_mean) if rollout_is_batch_normalize else None)
    if rollout_rs is not None:
        bounds = tuple(parse_rejection(rollout_rs, rollout_rs_threshold))
        rejected_by = {bound.option: in_response & ~rejection_keeps(log_ratio, response_mask, bound)
                       for bound in bounds}
        rejected = torch.stack(list(rejected_by.values())).any(dim=0)
        kept = (~rejected).to(log_ratio.dtype) * response_mask
        loss_weights = kept if correction.loss_weights is None else correction.loss_weights * kept
        correction = replace(correction, loss_weights=loss_weights, rejected=rejected, rejected_by=rejected_by,
                             bounds=bounds)
    return correction


def rollout_correction_from_config(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                                   response_mask: torch.Tensor, config, *,
                                   batch_mean: torch.Tensor | float | None = None) -> Correction:
    """`rollout_correction` with the keys of `config` (an `algorithm.rollout_correction` section)."""
    return rollout_correction(train_log_prob, rollout_log_prob, response_mask, rollout_is=config.rollout_is,
                              rollout_is_threshold=config.rollout_is_threshold,
                              rollout_is_batch_normalize=config.rollout_is_batch_normalize,
                              rollout_rs=config.rollout_rs, rollout_rs_threshold=config.rollout_rs_threshold,
                              batch_mean=batch_mean)


def mismatch_metrics(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                     correction: Correction) -> dict[str, float]:
    """How far the rollout's distribution is from the trainer's on these response tokens (sampled from the
    rollout's), and what `correction` did to them (docs/rollout-correction.md lists each metric and its verl
    name). Per-response statistics are over the responses with at least one token."""
    # float64: at fp32 rounding distances (log ratios ~1e-7) ρ - 1 - log ρ would cancel to 0 in float32.
    mask = response_mask.double()
    log_ratio = token_log_ratio(train_log_prob, rollout_log_prob, mask).double()
    ratio = log_ratio.exp()
    in_response = mask.bool()
    rows = mask.sum(dim=-1) > 0
    metrics = {
        "kl_k1": masked_mean(-log_ratio, mask).item(),
        "kl_k3": masked_mean(k3_divergence(log_ratio), mask).item(),
        "ratio_mean": masked_mean(ratio, mask).item(),
        "ratio_min": ratio[in_response].min().item() if in_response.any() else 1.0,
        "ratio_max": ratio[in_response].max().item() if in_response.any() else 1.0,
        "chi2_token": (masked_mean(ratio.square(), mask) - 1).item(),
        "chi2_seq": (level_log_ratio(log_ratio, mask, "sequence")[:, 0][rows].mul(2).exp().mean() - 1).item()
        if rows.any() else 0.0,
        "is_truncated_frac": masked_mean(correction.truncated.double(), mask).item(),
        "rejected_frac": masked_mean(correction.rejected.double(), mask).item(),
        **_perplexity_metrics(train_log_prob, rollout_log_prob, mask, rows),
    }
    if correction.raw_weights is not None:
        metrics.update(_is_metrics(correction, mask, rows))
    if correction.rejected_by:
        metrics.update(_rejection_metrics(correction, mask, rows))
        if rows.any():
            for bound in correction.bounds:
                metrics.update(_statistic_metrics(log_ratio, mask, rows, bound))
    return metrics


def _perplexity_metrics(train_log_prob, rollout_log_prob, mask, rows) -> dict[str, float]:
    """Per response, the log-perplexity (mean token NLL) under each policy and their difference (training minus
    rollout: > 0 where the trainer finds the samples less likely than the engine did), as batch means; the
    perplexities themselves are means of each response's."""
    if not rows.any():
        return {name: 0.0 for name in ("training_log_ppl", "rollout_log_ppl", "training_ppl", "rollout_ppl",
                                       "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min",
                                       "ppl_ratio")}
    training = -masked_mean(train_log_prob.double(), mask, dim=-1)[rows]
    rollout = -masked_mean(rollout_log_prob.double(), mask, dim=-1)[rows]
    difference = training - rollout
    return {"training_log_ppl": training.mean().item(), "rollout_log_ppl": rollout.mean().item(),
            "training_ppl": training.exp().mean().item(), "rollout_ppl": rollout.exp().mean().item(),
            "log_ppl_diff": difference.mean().item(), "log_ppl_abs_diff": difference.abs().mean().item(),
            "log_ppl_diff_max": difference.max().item(), "log_ppl_diff_min": difference.min().item(),
            "ppl_ratio": difference.exp().mean().item()}


def _is_metrics(correction: Correction, mask, rows) -> dict[str, float]:
    """verl's statistics of the untruncated weights: mean, extremes and the shares beyond [1/cap, cap] (over
    tokens at token level, over responses otherwise), the effective sample size of the weights clamped to
    [1/cap, cap] as a share of the tokens ((Σw)² / (n Σw²)) and their standard deviation, and the per-response
    mean weights' statistics."""
    raw, cap = correction.raw_weights.double(), correction.cap
    in_response = mask.bool()
    per_row = masked_mean(raw, mask, dim=-1)[rows]
    spread = per_row if correction.level != "token" else raw[in_response]
    clamped = raw.clamp(1 / cap, cap)
    metrics = {
        "rollout_is_mean": masked_mean(raw, mask).item(),
        "rollout_is_max": spread.max().item() if spread.numel() else 1.0,
        "rollout_is_min": spread.min().item() if spread.numel() else 1.0,
        "rollout_is_ratio_fraction_high": (spread > cap).double().mean().item() if spread.numel() else 0.0,
        "rollout_is_ratio_fraction_low": (spread < 1 / cap).double().mean().item() if spread.numel() else 0.0,
        "rollout_is_std": (masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
                           ).clamp_min(0).sqrt().item(),
        "rollout_is_eff_sample_size": (masked_mean(clamped, mask).square()
                                       / masked_mean(clamped.square(), mask).clamp_min(_MIN_BATCH_MEAN)).item(),
    }
    if per_row.numel():
        metrics.update({
            "rollout_is_seq_mean": per_row.mean().item(),
            "rollout_is_seq_std": per_row.std().item() if per_row.numel() > 1 else 0.0,
            "rollout_is_seq_max": per_row.max().item(), "rollout_is_seq_min": per_row.min().item(),
            "rollout_is_seq_max_deviation": (per_row - 1).abs().max().item(),
            "rollout_is_seq_fraction_high": (per_row > cap).double().mean().item(),
            "rollout_is_seq_fraction_low": (per_row < 1 / cap).double().mean().item(),
        })
    if correction.batch_mean is not None:
        metrics["rollout_is_batch_norm_factor"] = correction.batch_mean
    return metrics


def _rejection_metrics(correction: Correction, mask, rows) -> dict[str, float]:
    """The share of the tokens, and of the responses (any token), each option rejected, and all of them."""
    def responses_hit(rejected):
        return rejected.any(dim=-1)[rows].double().mean().item() if rows.any() else 0.0

    metrics = {"rollout_rs_seq_masked_fraction": responses_hit(correction.rejected)}
    for option, rejected in correction.rejected_by.items():
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(rejected.double(), mask).item()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = responses_hit(rejected)
    return metrics


def _statistic_metrics(log_ratio, mask, rows, bound: RejectionBound) -> dict[str, float]:
    """Where `bound`'s statistic lies, as verl's compute_rs_metrics reports it (rollout_rs_<option>_*): its token
    mean; its extremes and the shares beyond the band over tokens (token options) or responses (row options);
    the spread of the statistic clipped to the band; and over the responses' values (a token option's row mean)
    their mean, spread (unbiased), extremes, largest absolute value and shares beyond the band. The share below
    exists for k1 only, whose band has a lower end."""
    statistic = rejection_statistic(log_ratio, mask, bound)
    low, high = band(bound)
    signed = bound.lower is not None
    in_response = mask.bool()
    per_row = (statistic[:, 0] if bound.aggregation != "token" else masked_mean(statistic, mask, dim=-1))[rows]
    values = statistic[in_response] if bound.aggregation == "token" else per_row
    clipped = statistic.clamp(low, high)
    variance = masked_mean(clipped.square(), mask) - masked_mean(clipped, mask).square()
    name = f"rollout_rs_{bound.option}"
    metrics = {
        f"{name}_mean": masked_mean(statistic, mask).item(),
        f"{name}_max": values.max().item(), f"{name}_min": values.min().item(),
        f"{name}_fraction_high": (values > high).double().mean().item(),
        f"{name}_fraction_low": (values < low).double().mean().item() if signed else 0.0,
        f"{name}_std": variance.clamp_min(0).sqrt().item() if mask.sum() > 1 else 0.0,
        f"{name}_seq_mean": per_row.mean().item(),
        f"{name}_seq_std": per_row.std().item() if len(per_row) > 1 else 0.0,
        f"{name}_seq_max": per_row.max().item(), f"{name}_seq_min": per_row.min().item(),
        f"{name}_seq_max_deviation": per_row.abs().max().item(),
        f"{name}_seq_fraction_high": (per_row > high).double().mean().item(),
    }
    if signed:
        metrics[f"{name}_seq_fraction_low"] = (per_row < low).double().mean().item()
    return metrics


def mismatch_metrics_by_source(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                               response_mask: torch.Tensor, correction: Correction,
                               sources: Sequence[str | None]) -> dict[str, float]:
    """`mismatch_metrics` over all rows, named `<metric>`, and over the rows of each of `sources` (one per row,
    None: none), named `<metric>/<source>`."""
    metrics = mismatch_metrics(train_log_prob, rollout_log_prob, response_mask, correction)
    for source in sorted({source for source in sources if source is not None}):
        rows = torch.tensor([row for row, name in enumerate(sources) if name == source])
        for name, value in mismatch_metrics(train_log_prob[rows], rollout_log_prob[rows], response_mask[rows],
                                            correction.rows(rows)).items():
            metrics[f"{name}/{source}"] = value
    return metrics
