"""DAPO's data-side functions on hand-built groups: the group filter over rounds, cutting a partial batch to whole
mini-batches, the soft overlong punishment at its buffer's edges, and the detection of truncated responses."""
import pytest
import torch

from verl_mega.algorithms import (
    BatchNotFilled, GroupFilter, constant_groups, groups_filling_mini_batches, overlong_filtered_mask, overlong_penalty,
    trainable_groups, truncated_responses,
)


def scores(*groups):
    return torch.tensor([value for group in groups for value in group], dtype=torch.float32)


def test_groups_whose_responses_all_score_the_same_are_constant():
    values = scores([1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.25], [float("nan")] * 3)
    # A NaN equals nothing: its group is kept and reaches the trainer's non-finite check.
    assert constant_groups(values, 3).tolist() == [True, False, True, False, False]
    with pytest.raises(ValueError, match="groups of 4"):
        constant_groups(values, 4)


def test_the_filter_drops_constant_groups_and_cuts_the_last_round_to_the_batch():
    groups = GroupFilter(target_groups=3, group_size=2, max_rounds=5)
    assert groups.keep(scores([1, 1], [0, 1], [0, 0])).tolist() == [False, True, False]
    assert not groups.done
    # Three informative groups, room for two: the surplus is cut, in order.
    assert groups.keep(scores([1, 0], [0, 0], [0.5, 1], [1, 0.5])).tolist() == [True, False, True, False]
    assert groups.full and groups.done and not groups.exhausted
    assert groups.metrics() == {"filter_groups/kept_groups": 3, "filter_groups/dropped_groups": 3,
                                "filter_groups/gen_rounds": 2}
    with pytest.raises(RuntimeError, match="done"):
        groups.keep(scores([1, 0]))


def test_the_filter_stops_after_max_rounds_and_zero_means_no_bound():
    bounded = GroupFilter(target_groups=2, group_size=2, max_rounds=2)
    bounded.keep(scores([1, 1], [0, 1]))
    bounded.keep(scores([1, 1], [0, 0]))
    assert bounded.exhausted and bounded.done and bounded.kept == 1 and bounded.rounds == 2
    unbounded = GroupFilter(target_groups=2, group_size=2, max_rounds=0)
    for _ in range(50):
        unbounded.keep(scores([1, 1], [0, 0]))
    assert not unbounded.done and unbounded.dropped == 100


def test_without_dropping_one_round_fills_the_batch():
    groups = GroupFilter(target_groups=2, group_size=2, max_rounds=1, drop_constant=False)
    assert groups.keep(scores([1, 1], [0, 0])).tolist() == [True, True]
    assert groups.full and groups.dropped == 0


@pytest.mark.parametrize("groups, group_size, sizes, expected", [
    (7, 4, [8], 6),  # 2 groups per mini-batch of 8 rows
    (7, 4, [8, 12], 6),  # whole mini-batches of both: multiples of lcm(8, 12) = 24 rows, 6 groups
    (5, 4, [8, 12], 0),
    (1, 4, [8], 0),  # not even one mini-batch
    (5, 3, [2], 4),  # 3 rows a group, 2 a mini-batch: an even number of groups
    (9, 8, [4], 9),  # every group fills whole mini-batches
])
def test_a_partial_batch_is_cut_to_whole_mini_batches(groups, group_size, sizes, expected):
    assert groups_filling_mini_batches(groups, group_size, sizes) == expected


def test_the_overlong_penalty_is_zero_up_to_the_buffer_and_linear_to_the_budget():
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10])
    # Budget 10, buffer 4: lengths up to 6 are free; 7..10 cost 1/4 .. 4/4 of the factor 0.5.
    penalty = overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=0.5)
    assert penalty.tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    assert penalty.dtype == torch.float32
    whole = overlong_penalty(torch.tensor([0, 2, 4]), max_response_length=4, buffer_len=4, penalty_factor=1.0)
    assert whole.tolist() == [0.0, -0.5, -1.0]
    for bad in (0, 11):
        with pytest.raises(ValueError, match="buffer_len"):
            overlong_penalty(lengths, max_response_length=10, buffer_len=bad, penalty_factor=1.0)


def test_truncated_responses_fill_the_budget_without_a_stop_token():
    eos, pad = 2, 0
    responses = torch.tensor([[5, 6, 7], [5, 6, eos], [5, eos, pad], [5, 9, 9], [eos, pad, pad]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    assert truncated_responses(responses, mask, [eos]).tolist() == [True, False, False, True, False]
    # A second stop id (a model config listing several EOS tokens) finishes a response too.
    assert truncated_responses(responses, mask, [eos, 9]).tolist() == [True, False, False, False, False]
    # Overlong filtering: the truncated rows leave the loss's mask, the finished ones keep theirs as they are.
    assert overlong_filtered_mask(responses, mask, [eos]).tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0],
                                                                       [1, 0, 0]]


def exhausted_filter(kept_groups: int) -> GroupFilter:
    """A filter out of rounds with `kept_groups` of 8 groups of 4 kept."""
    groups = GroupFilter(target_groups=8, group_size=4, max_rounds=1)
    groups.keep(scores(*([[0, 1, 0, 0]] * kept_groups + [[1, 1, 1, 1]] * (8 - kept_groups))))
    assert groups.exhausted
    return groups


def test_out_of_rounds_the_step_stops_or_trains_on_whole_mini_batches():
    with pytest.raises(BatchNotFilled, match="kept 5 of 8 groups in 1 rounds"):
        trainable_groups(exhausted_filter(5), "stop", [8])
    assert trainable_groups(exhausted_filter(5), "train", [8]) == 4  # 2 groups of 4 rows per mini-batch of 8
    assert trainable_groups(exhausted_filter(1), "train", [8]) == 0
    with pytest.raises(ValueError, match="on_exhausted"):
        trainable_groups(exhausted_filter(5), "skip", [8])


def test_a_full_batch_trains_whole_whatever_the_policy():
    groups = GroupFilter(target_groups=2, group_size=4, max_rounds=1)
    groups.keep(scores([0, 1, 1, 1], [0, 0, 0, 0.5]))
    assert trainable_groups(groups, "stop", [8]) == trainable_groups(groups, "train", [8]) == 2
