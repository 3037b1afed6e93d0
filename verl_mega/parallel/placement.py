"""Which global ranks train and which only generate (`placement_for` makes this rank's `layout.RolePlacement`), and
who sends which weights to whom: pure arithmetic.

Colocated (`parallel.rollout_ranks: 0`, the default): every rank trains and generates through the
HybridEngine. Disaggregated: the LAST `rollout_ranks` global ranks run only rollout engines (on Slurm they
fill the last nodes, torchrun numbering each node's ranks consecutively), in replicas of `rollout_tp`
consecutive ranks; the first ranks run the 3D training layout on a world of their own.

After an optimizer step every training rank streams the HybridEngine at the rollout TP, so each holds one
rollout TP slice j = (tp_rank // (tp / rollout_tp)). The rollout rank of replica r and rollout TP rank j
receives slice j from the (r mod n)-th of the n training ranks holding it: with several replicas the pushes
spread over the data-parallel and pipeline ranks instead of queueing on one sender.

Every failure is a ValueError naming the sizes by the names the caller's user knows them (`names`, as in
`layout`).
"""
from __future__ import annotations

from dataclasses import dataclass

from .layout import RolePlacement, _name, check_rollout_tp, check_sizes, data_parallel_size


def check_placement(global_size: int, rollout_ranks: int, rollout_tp: int = 1,
                    names: dict[str, str] | None = None) -> None:
    """Refuse a split that leaves no training rank or cuts a rollout replica."""
    check_sizes({"global_size": global_size}, names)
    key = _name(names, "rollout_ranks")
    if isinstance(rollout_ranks, bool) or not isinstance(rollout_ranks, int) or rollout_ranks < 0:
        raise ValueError(f"{key} must be an integer >= 0 (0: colocated), got {rollout_ranks!r}")
    if rollout_ranks == 0:
        return
    check_sizes({"rollout_tp": rollout_tp}, names)
    if rollout_ranks >= global_size:
        raise ValueError(f"{key}={rollout_ranks} must leave at least one training rank in a world of "
                         f"{global_size} processes")
    if rollout_ranks % rollout_tp:
        raise ValueError(f"{key}={rollout_ranks} must be a multiple of {_name(names, 'rollout_tp')}={rollout_tp} "
                         "(whole rollout replicas)")


def placement_for(global_rank: int, global_size: int, rollout_ranks: int, rollout_tp: int = 1, train_tp: int = 1,
                  names: dict[str, str] | None = None) -> RolePlacement:
    """The placement of `global_rank` in a world of `global_size` whose last `rollout_ranks` ranks generate."""
    check_placement(global_size, rollout_ranks, rollout_tp, names)
    if not 0 <= global_rank < global_size:
        raise ValueError(f"rank {global_rank} is outside a world of {global_size} processes")
    first_rollout = global_size - rollout_ranks
    role = "train" if global_rank < first_rollout else "rollout"
    return RolePlacement(role, global_rank, global_size, tuple(range(first_rollout)),
                         tuple(range(first_rollout, global_size)), rollout_tp, train_tp)


def training_data_parallel_size(placement: RolePlacement, tp: int, pp: int, ep: int = 1,
                                names: dict[str, str] | None = None, cp: int = 1) -> int:
    """DP of the training ranks at (tp, pp, ep, cp), or raise naming what does not fit them."""
    try:
        return data_parallel_size(len(placement.train_ranks), tp, pp, ep, names, cp)
    except ValueError as error:
        if not placement.disaggregated:
            raise
        raise ValueError(f"{_name(names, 'rollout_ranks')}={len(placement.rollout_ranks)} leaves "
                         f"{len(placement.train_ranks)} training processes: {error}") from None


@dataclass(frozen=True)
class WeightRoute:
    """One rollout rank's weights: the training rank `source` sends it rollout TP slice `slice`."""

    source: int
    target: int
    slice: int


def slice_holders(placement: RolePlacement) -> list[list[int]]:
    """For each rollout TP slice j, the global training ranks whose HybridEngine stream holds it."""
    tp = placement.train_tp
    check_rollout_tp(tp, placement.rollout_tp)
    micro_dp = tp // placement.rollout_tp
    holders: list[list[int]] = [[] for _ in range(placement.rollout_tp)]
    for index, rank in enumerate(placement.train_ranks):
        holders[(index % tp) // micro_dp].append(rank)
    return holders


def rollout_peer(placement: RolePlacement, rollout_rank: int) -> WeightRoute:
    """Which training rank sends which rollout TP slice to global rank `rollout_rank`."""
    at = placement.rollout_coordinates(rollout_rank)
    holders = slice_holders(placement)[at.rollout_tp_rank]
    return WeightRoute(holders[at.replica % len(holders)], rollout_rank, at.rollout_tp_rank)


def weight_routes(placement: RolePlacement) -> tuple[WeightRoute, ...]:
    """Every rollout rank's route, in rollout rank order (empty when colocated)."""
    return tuple(rollout_peer(placement, rank) for rank in placement.rollout_ranks)
