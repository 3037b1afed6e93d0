"""Masked reductions, whitening and loss aggregation."""

import pytest
import torch

from verl_mega.algorithms.masked import agg_loss, agg_units, masked_mean, masked_sum, masked_var, masked_whiten

# Ragged batch: sequence 0 has 3 response tokens, sequence 1 has 1.
LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
RAGGED_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def test_masked_sum_mean_var_ignore_masked_values():
    # unmasked values: 1, 2, 3, 4 -> sum 10, mean 2.5, unbiased var = (2.25+0.25+0.25+2.25)/3 = 5/3
    assert masked_sum(LOSS_MAT, RAGGED_MASK).item() == pytest.approx(10.0)
    assert masked_mean(LOSS_MAT, RAGGED_MASK).item() == pytest.approx(2.5)
    assert masked_var(LOSS_MAT, RAGGED_MASK).item() == pytest.approx(5 / 3)
    assert masked_var(LOSS_MAT, RAGGED_MASK, unbiased=False).item() == pytest.approx(5 / 4)
    # per row: [ (1+2+3)/3, 4/1 ]
    torch.testing.assert_close(masked_mean(LOSS_MAT, RAGGED_MASK, dim=-1), torch.tensor([2.0, 4.0]))


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    assert masked_mean(LOSS_MAT, torch.zeros_like(RAGGED_MASK)).item() == 0.0


def test_masked_reductions_accept_bool_masks_and_count_bf16_exactly():
    values = torch.ones(257, dtype=torch.bfloat16)
    mask = torch.ones(257, dtype=torch.bool)
    # bf16 has 8 significant bits, so a bf16 sum would round 257 to 256; the float32 accumulator must not.
    assert torch.ones(257, dtype=torch.bfloat16).sum().item() == 256.0
    assert masked_sum(values, mask).item() == 257.0


def test_masked_whiten_gives_zero_mean_unit_variance_on_mask():
    whitened = masked_whiten(LOSS_MAT, RAGGED_MASK)
    # (x - 2.5) / sqrt(5/3) on the unmasked values
    expected = (torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5) / (5 / 3) ** 0.5
    torch.testing.assert_close(whitened[RAGGED_MASK.bool()], expected)
    kept_mean = masked_whiten(LOSS_MAT, RAGGED_MASK, shift_mean=False)
    torch.testing.assert_close(kept_mean[RAGGED_MASK.bool()], expected + 2.5)


def test_shape_mismatch_raises_value_error_naming_the_argument():
    with pytest.raises(ValueError, match="mask"):
        masked_mean(LOSS_MAT, RAGGED_MASK[:, :2])
    with pytest.raises(ValueError, match="loss_mask"):
        agg_loss(LOSS_MAT, RAGGED_MASK[:1])


@pytest.mark.parametrize(
    "mode, expected",
    [
        # all unmasked tokens: (1 + 2 + 3 + 4) / 4
        ("token-mean", 2.5),
        # token sums per sequence: [6, 4] -> mean 5
        ("seq-mean-token-sum", 5.0),
        # token means per sequence: [2, 4] -> mean 3
        ("seq-mean-token-mean", 3.0),
        # Dr. GRPO: token sums [6, 4] divided by the padded length 3, then mean -> 5 / 3
        ("seq-mean-token-sum-norm", 5.0 / 3.0),
    ],
)
def test_agg_loss_modes_on_ragged_mask(mode, expected):
    assert agg_loss(LOSS_MAT, RAGGED_MASK, mode).item() == pytest.approx(expected)


def test_seq_mean_token_mean_skips_sequences_without_tokens():
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    # only sequence 0 counts: (1 + 2 + 3) / 3
    assert agg_loss(LOSS_MAT, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)


@pytest.mark.parametrize("mode, expected", [
    ("seq-mean-token-sum", 6.0),  # only sequence 0 counts: 1 + 2 + 3
    ("seq-mean-token-mean", 2.0),
])
def test_the_seq_mean_modes_skip_sequences_without_tokens(mode, expected):
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert agg_loss(LOSS_MAT, mask, mode).item() == pytest.approx(expected)
    assert agg_units(mask, mode).item() == 1


def test_dr_grpo_norm_divides_by_every_row_times_the_response_budget():
    """Dr. GRPO's constant: a fully masked row still counts (the paper's 1/G, and verl's), so the loss is
    sum / (rows x padded length) = 6 / (2 x 3), not 6 / 3 as when the empty row was skipped."""
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert agg_loss(LOSS_MAT, mask, "seq-mean-token-sum-norm").item() == pytest.approx(1.0)
    assert agg_units(mask, "seq-mean-token-sum-norm").item() == 6
    assert agg_units(torch.zeros(4, 5), "seq-mean-token-sum-norm").item() == 20


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_of_a_batch_is_the_unit_weighted_sum_of_its_parts(mode):
    """What distributed training relies on: splitting rows into micro-batches, each aggregated alone and
    weighted by its share of the units, gives the whole batch's aggregate (a fully masked row included)."""
    loss = torch.arange(12.0).reshape(4, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    whole = agg_loss(loss, mask, mode)
    total_units = agg_units(mask, mode)
    parts = sum(agg_loss(loss[rows], mask[rows], mode) * agg_units(mask[rows], mode) / total_units
                for rows in (slice(0, 2), slice(2, 4)))
    torch.testing.assert_close(parts, whole)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_parts_trimmed_of_padding_columns_still_sum_to_the_whole(mode):
    """Micro-batches lose their all-padding response columns (roles.batching.trim_padding) while the mini-batch's
    units are counted untrimmed: Dr. GRPO's constant (the full budget) must survive that."""
    loss = torch.arange(12.0).reshape(4, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    whole = agg_loss(loss, mask, mode)
    total_units = agg_units(mask, mode)
    first, second = (loss[:2, :2], mask[:2, :2]), (loss[2:], mask[2:])  # rows 0-1 need only 2 columns
    parts = sum(agg_loss(part_loss, part_mask, mode) * agg_units(part_mask, mode) / total_units
                for part_loss, part_mask in (first, second))
    torch.testing.assert_close(parts, whole)


def test_agg_loss_unknown_mode_lists_modes():
    with pytest.raises(ValueError, match="seq-mean-token-sum"):
        agg_loss(LOSS_MAT, RAGGED_MASK, "token-sum")
