"""Statistics over a process group equal the statistics of the concatenated batch (2 CPU ranks, gloo)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_mega.algorithms.kl import apply_kl_penalty
from verl_mega.algorithms.masked import masked_mean, masked_whiten
from verl_mega.algorithms.normalize import RunningMeanStd

WORLD_SIZE = 2


def shards():
    """Each rank's (values, mask); rank 1 has a different number of response tokens than rank 0."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(WORLD_SIZE, 3, 4, generator=generator)
    mask = torch.ones(WORLD_SIZE, 3, 4)
    mask[0, :, 3] = 0
    mask[1, 0, 1:] = 0
    return values, mask


def check_rank(rank, store_path):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE)
    try:
        group = dist.group.WORLD
        values, mask = shards()
        all_values, all_mask = values.reshape(-1, 4), mask.reshape(-1, 4)

        global_mean = masked_mean(all_values, all_mask)
        torch.testing.assert_close(masked_mean(values[rank], mask[rank], group=group), global_mean)
        whitened = masked_whiten(values[rank], mask[rank], group=group)
        torch.testing.assert_close(whitened, masked_whiten(all_values, all_mask).reshape(WORLD_SIZE, 3, 4)[rank])

        stats = RunningMeanStd()
        stats.update(values[rank], mask[rank], group=group)
        on_mask = all_values[all_mask.bool()].double()
        assert stats.count == on_mask.numel()
        assert stats.mean == pytest.approx(on_mask.mean().item())
        assert stats.std == pytest.approx(on_mask.std().item())

        zeros = torch.zeros(3, 4)
        _, current_kl = apply_kl_penalty(zeros, values[rank], zeros, mask[rank], kl_coef=0.1, group=group)
        _, global_kl = apply_kl_penalty(zeros.repeat(2, 1), all_values, zeros.repeat(2, 1), all_mask, kl_coef=0.1)
        torch.testing.assert_close(current_kl, global_kl)
    finally:
        dist.destroy_process_group()


def test_group_statistics_match_concatenated_batch(tmp_path):
    # Any assertion failing in a rank re-raises here.
    mp.spawn(check_rank, args=(str(tmp_path / "store"),), nprocs=WORLD_SIZE, join=True)
