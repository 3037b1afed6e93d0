import itertools

import pytest
import torch

from verl_mega.data.sampler import ResumableBatchSampler


def take_batches(sampler, count):
    """Draws `count` batches, crossing epoch boundaries, as a training loop over epochs would."""
    batches = []
    while len(batches) < count:
        batches.extend(itertools.islice(iter(sampler), count - len(batches)))
    return batches


def test_each_epoch_is_a_permutation_in_fixed_size_batches():
    sampler = ResumableBatchSampler(num_samples=10, batch_size=3, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 3
    assert all(len(batch) == 3 for batch in batches)
    flat = sum(batches, [])
    assert len(set(flat)) == 9 and set(flat) <= set(range(10))


def test_keeping_the_last_incomplete_batch():
    sampler = ResumableBatchSampler(num_samples=10, batch_size=3, seed=1, drop_last=False)
    batches = list(sampler)
    assert [len(batch) for batch in batches] == [3, 3, 3, 1]
    assert sorted(sum(batches, [])) == list(range(10))


def test_same_seed_same_order_and_epochs_reshuffle():
    first, second = (ResumableBatchSampler(20, 4, seed=7) for _ in range(2))
    epoch0, epoch1 = list(first), list(first)
    assert epoch0 == list(second)
    assert epoch1 == list(second)
    assert epoch0 != epoch1
    assert epoch0 != list(ResumableBatchSampler(20, 4, seed=8))


def test_order_depends_on_seed_plus_epoch():
    sampler = ResumableBatchSampler(12, 4, seed=3)
    list(sampler)
    epoch1 = sum(list(sampler), [])
    expected = torch.randperm(12, generator=torch.Generator().manual_seed(4)).tolist()
    assert epoch1 == expected


@pytest.mark.parametrize("consumed", [2, 5, 6, 9])  # mid-epoch, exactly at an epoch end, into epoch 3
def test_resumed_sampler_continues_exactly(consumed):
    reference = take_batches(ResumableBatchSampler(17, 5, seed=11), consumed + 7)

    interrupted = ResumableBatchSampler(17, 5, seed=11)
    assert take_batches(interrupted, consumed) == reference[:consumed]
    state = interrupted.state_dict()

    resumed = ResumableBatchSampler(17, 5, seed=0)
    resumed.load_state_dict(state)
    assert resumed.seed == 11
    assert take_batches(resumed, 7) == reference[consumed:]


def test_state_counts_the_batch_being_held():
    sampler = ResumableBatchSampler(9, 3, seed=0)
    iterator = iter(sampler)
    next(iterator)
    assert sampler.state_dict() == {"epoch": 0, "batch_index": 1, "seed": 0}
    next(iterator), next(iterator)
    assert sampler.state_dict() == {"epoch": 0, "batch_index": 3, "seed": 0}
    assert list(iterator) == []
    assert sampler.state_dict() == {"epoch": 1, "batch_index": 0, "seed": 0}


def test_resume_through_a_dataloader():
    dataset = list(range(100, 113))
    reference_sampler = ResumableBatchSampler(len(dataset), 4, seed=5)
    reference = [batch.tolist() for batch in torch.utils.data.DataLoader(dataset, batch_sampler=reference_sampler)]

    sampler = ResumableBatchSampler(len(dataset), 4, seed=5)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    seen = [batch.tolist() for batch in itertools.islice(loader, 1)]
    resumed = ResumableBatchSampler(len(dataset), 4, seed=5)
    resumed.load_state_dict(sampler.state_dict())
    seen += [batch.tolist() for batch in torch.utils.data.DataLoader(dataset, batch_sampler=resumed)]
    assert seen == reference


def test_too_few_samples_for_a_batch():
    with pytest.raises(ValueError, match="3 samples cannot fill one batch of 4 with drop_last=True"):
        ResumableBatchSampler(3, 4)
    assert len(ResumableBatchSampler(3, 4, drop_last=False)) == 1


def test_next_batch_rolls_over_epochs_as_iterating_does_and_resumes_there():
    # What a job draws one step at a time: the batches of iterating epoch after epoch, the rollover included.
    drawn = ResumableBatchSampler(10, 3, seed=4)
    iterated = ResumableBatchSampler(10, 3, seed=4)
    expected = [batch for _ in range(3) for batch in iterated]
    assert [drawn.next_batch() for _ in range(9)] == expected
    # A state saved while holding the last batch of an epoch resumes at the next epoch's first batch.
    held = ResumableBatchSampler(10, 3, seed=4)
    for _ in range(3):
        held.next_batch()
    restored = ResumableBatchSampler(10, 3, seed=0)
    restored.load_state_dict(held.state_dict())
    assert held.state_dict() == {"epoch": 0, "batch_index": 3, "seed": 4}
    assert restored.next_batch() == held.next_batch() == expected[3]
