"""Masked reductions over response tokens, whitening, and loss aggregation.

Statistics accept an optional process group: when given, sums and counts are all-reduced over it so every
data-parallel rank gets the statistics of the global batch (no gradient flows across ranks). None = local.
Reductions accumulate in float32 or wider: a bf16 count is no longer exact past 256 tokens.
"""

import torch
import torch.distributed as dist

from verl_mega.algorithms.registry import Registry

# Makes an all-masked reduction 0 instead of 0/0 while leaving any real count, even a fractional weight, exact.
_MIN_COUNT = 1e-8
_WHITEN_EPS = 1e-8


def check_same_shape(reference_name: str, reference, **tensors) -> None:
    """Raise ValueError naming the first tensor in `tensors` whose shape differs from `reference`'s."""
    for name, tensor in tensors.items():
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)}"
                f" (the shape of {reference_name})"
            )


def masked_sum_and_count(values, mask, dim=None, group=None):
    """(sum of values * mask, sum of mask) over `dim` (None = all elements), optionally over `group`."""
    check_same_shape("values", values, mask=mask)
    if group is not None and dim is not None:
        raise ValueError("dim must be None when group is given: only whole-batch sums are reduced across ranks")
    acc_dtype = torch.promote_types(values.dtype, torch.float32)
    weights = mask.to(acc_dtype)
    total = (values.to(acc_dtype) * weights).sum(dim=dim)
    count = weights.sum(dim=dim)
    if group is None:
        return total, count
    # One collective for both numbers.
    stats = torch.stack([total, count])
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    return stats[0], stats[1]


def masked_sum(values, mask, dim=None, group=None):
    return masked_sum_and_count(values, mask, dim, group)[0]


def masked_mean(values, mask, dim=None, group=None):
    """Mean of the unmasked values; 0 where nothing is unmasked."""
    total, count = masked_sum_and_count(values, mask, dim, group)
    return total / count.clamp_min(_MIN_COUNT)


def masked_var(values, mask, unbiased=True, group=None):
    """Variance of the unmasked values (two passes, so it stays exact when the mean is large)."""
    mean = masked_mean(values, mask, group=group)
    squared_error_sum, count = masked_sum_and_count((values - mean) ** 2, mask, group=group)
    if unbiased:
        count = count - 1
    return squared_error_sum / count.clamp_min(_MIN_COUNT)


def masked_whiten(values, mask, shift_mean=True, group=None):
    """(values - mean) / std over the unmasked values; with shift_mean=False the mean is kept."""
    mean = masked_mean(values, mask, group=group)
    var = masked_var(values, mask, group=group)
    whitened = (values - mean) * torch.rsqrt(var + _WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.to(values.dtype)


# A loss aggregation mode is a mean over *units*: tokens ("token-mean"), sequences that hold at least one
# response token (the seq-mean modes; a fully masked row carries no signal and counting it as 0 would shrink
# the loss), or for Dr. GRPO's "seq-mean-token-sum-norm" every (row, response column) slot: its constant
# normaliser is the batch's rows x the response budget whatever the masks hold. Each mode registers the sum of
# its per-unit losses; `agg_units` counts the units, the one place that count is written, so a micro-batch's
# share of a distributed mini-batch uses the same definition.
LOSS_AGG_MODES = Registry("loss_agg_mode")


def agg_units(loss_mask, loss_agg_mode="token-mean"):
    """The number of units `loss_agg_mode` averages over (float32 or wider)."""
    LOSS_AGG_MODES.get(loss_agg_mode)  # refuses an unknown mode with the known ones
    weights = loss_mask.to(torch.promote_types(loss_mask.dtype, torch.float32))
    if loss_agg_mode == "token-mean":
        return weights.sum()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        # Every row counts, its mask whatever it holds: rows x the padded response length. A micro-batch
        # trimmed of padding columns counts fewer slots, and its aggregate is divided by fewer: its units times
        # its aggregate stay its token sum, so its share of the mini-batch's units still weights it right.
        return weights.new_tensor(float(weights.numel()))
    return (weights.sum(dim=-1) > 0).to(weights.dtype).sum()


@LOSS_AGG_MODES.register("token-mean")
def _token_sum(loss_mat, loss_mask):
    return masked_sum(loss_mat, loss_mask)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def _sequence_token_sums(loss_mat, loss_mask):
    return masked_sum(loss_mat, loss_mask, dim=-1).sum()


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def _sequence_token_means(loss_mat, loss_mask):
    return masked_mean(loss_mat, loss_mask, dim=-1).sum()


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _sequence_token_sums_normalised(loss_mat, loss_mask):
    # Dr. GRPO: each sequence's token sum over one constant, the response budget (the padded length), instead of
    # its own length, so long responses are not down-weighted per token; `agg_units` divides by rows x budget.
    return masked_sum(loss_mat, loss_mask)


def agg_loss(loss_mat, loss_mask, loss_agg_mode="token-mean"):
    """Reduce a (batch, response_length) token loss to a scalar: the mean over `loss_agg_mode`'s units of their
    losses (0 when there is none); modes are listed in LOSS_AGG_MODES."""
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be (batch, response_length), got shape {tuple(loss_mat.shape)}")
    check_same_shape("loss_mat", loss_mat, loss_mask=loss_mask)
    unit_losses = LOSS_AGG_MODES.get(loss_agg_mode)(loss_mat, loss_mask)
    return unit_losses / agg_units(loss_mask, loss_agg_mode).clamp_min(_MIN_COUNT)
