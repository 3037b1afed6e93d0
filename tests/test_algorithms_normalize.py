"""Running mean/std normaliser."""

import pytest
import torch

from verl_mega.algorithms.normalize import RunningMeanStd


def test_running_stats_equal_torch_mean_std_of_concatenated_batches():
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=generator) * 3 + 5 for n in (1, 7, 64, 3)]
    stats = RunningMeanStd()
    for batch in batches:
        stats.update(batch)
    everything = torch.cat(batches).double()
    assert stats.count == everything.numel()
    assert stats.mean == pytest.approx(everything.mean().item(), rel=1e-12)
    assert stats.std == pytest.approx(everything.std().item(), rel=1e-12)  # unbiased, like torch.std


def test_masked_values_are_not_counted():
    stats = RunningMeanStd()
    stats.update(torch.tensor([[1.0, 2.0, 1e6], [3.0, 1e6, 1e6]]), mask=torch.tensor([[1, 1, 0], [1, 0, 0]]))
    # only 1, 2, 3: mean 2, unbiased var (1 + 0 + 1) / 2 = 1
    assert (stats.count, stats.mean, stats.var) == (3.0, pytest.approx(2.0), pytest.approx(1.0))
    stats.update(torch.ones(2, 2), mask=torch.zeros(2, 2))
    assert stats.count == 3.0


def test_normalize_uses_running_stats():
    stats = RunningMeanStd(epsilon=0.0)
    stats.update(torch.tensor([1.0, 2.0, 3.0]))
    # mean 2, std 1
    torch.testing.assert_close(stats.normalize(torch.tensor([4.0, 0.0])), torch.tensor([2.0, -2.0]))
    torch.testing.assert_close(stats.normalize(torch.tensor([4.0]), shift_mean=False), torch.tensor([4.0]))


def test_fresh_normaliser_is_identity():
    values = torch.tensor([3.0, -1.0])
    torch.testing.assert_close(RunningMeanStd(epsilon=0.0).normalize(values), values)


def test_state_dict_round_trip_continues_identically():
    original = RunningMeanStd()
    original.update(torch.tensor([1.0, 5.0, 2.0]))
    restored = RunningMeanStd()
    restored.load_state_dict(original.state_dict())
    for stats in (original, restored):
        stats.update(torch.tensor([10.0, -4.0]))
    assert restored.state_dict() == original.state_dict()
    assert restored.count == 5.0
