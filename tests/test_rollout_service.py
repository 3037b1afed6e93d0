"""Seams of the disaggregated placement that no launch on this machine reaches: which message each rollout rank
gets from the training ranks' client when a replica spans several ranks (rollout TP 2, two replicas: 6
processes, beyond what the CI's 2 cores run end to end), and the bridge's process groups on GPUs (NCCL, absent
from the CPU build of torch)."""
from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from verl_mega.parallel import bridge
from verl_mega.parallel.placement import placement_for
from verl_mega.trainer.rl.rollout_service import replica_bounds, replica_leaders, replica_messages


def test_every_rank_of_a_replica_gets_its_replicas_share_and_only_its_first_rank_answers():
    """2 training ranks (TP 2) and 4 rollout ranks at rollout TP 2: replicas (2, 3) and (4, 5). Could fail if
    the rollout TP ranks of a replica were sent different prompts (their engines' collectives would hang or mix
    them), or two ranks of one replica answered."""
    placement = placement_for(0, 6, 4, rollout_tp=2, train_tp=2)
    shares = [["prompts of replica 0"], ["prompts of replica 1"]]
    assert replica_messages(placement, lambda replica: ("generate", shares[replica])) == [
        (2, ("generate", shares[0])), (3, ("generate", shares[0])),
        (4, ("generate", shares[1])), (5, ("generate", shares[1]))]
    assert replica_leaders(placement) == [2, 4]


@pytest.mark.parametrize("prompts, replicas", [(8, 2), (5, 2), (3, 4), (0, 3)])
def test_replica_shares_cover_every_prompt_once_as_evenly_as_the_count_allows(prompts, replicas):
    bounds = replica_bounds(prompts, replicas)
    assert bounds[0] == 0 and bounds[-1] == prompts and len(bounds) == replicas + 1
    sizes = [end - start for start, end in zip(bounds, bounds[1:])]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0


class RecordedNCCLGroup:
    """What the bridge hands torch's ProcessGroupNCCL on a GPU machine (the CPU build of torch has none)."""

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, options):
        self.store, self.rank, self.size, self.options = store, rank, size, options


def test_the_bridge_on_gpus_makes_nccl_groups_over_global_ranks_with_its_timeout(monkeypatch):
    """On a CUDA world the bridge and its broadcast subgroups are NCCL groups of the job's store, at the global
    rank (a subgroup: the rank among its members) and with the bridge's timeout, not NCCL's default of 10
    minutes. Could fail if the NCCL branch passed the role's rank, the default timeout, or built gloo groups."""
    monkeypatch.setattr(bridge, "backend", lambda: "nccl")
    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordedNCCLGroup, raising=False)
    store, timeout = dist.HashStore(), datetime.timedelta(seconds=42)
    placement = placement_for(3, 4, 2, rollout_tp=1, train_tp=1)
    for rank in range(4):  # the other ranks' introductions, as they would publish them
        store.set(f"peer/{rank}", f'{{"role": "{"train" if rank < 2 else "rollout"}", "pid": {rank}, "host": "h"}}')
    built = bridge.Bridge(placement, store, timeout.total_seconds())
    group = built._group
    assert isinstance(group, RecordedNCCLGroup) and (group.store, group.rank, group.size) == (store, 3, 4)
    assert group.options._timeout == timeout
    subgroup = built._subgroup((1, 3))
    assert isinstance(subgroup, RecordedNCCLGroup) and (subgroup.rank, subgroup.size) == (1, 2)
    assert subgroup.options._timeout == timeout
    assert str(built.peers[2]) == "rollout rank 2 (pid 2 on h)"
