"""Layout arithmetic, in one place: which sizes must divide which, and which rank holds which slice.

Pure integer functions (no process groups), so the pre-flight check, `init_parallel`, the converters,
the HybridEngine, the planner and the trainer all ask the same questions the same way; and the records of a
layout, one per concept: a rank's place in megatron's grid (`RankCoordinates`), the live process's with the
grid's sizes (`ParallelLayout`), a rank's place among the rollout replicas (`RolloutCoordinates`) and a global
rank's role in the split into training and rollout ranks (`RolePlacement`, made by `placement.placement_for`). Every failure is a
ValueError naming the sizes that do not fit, by the names the caller's user knows them (`names`: e.g.
{"tp": "parallel.tp"} for a config, {"tp": "--tp"} for a command line).

Ranks are numbered as megatron-core numbers them: TP fastest, then DP, then PP (EP splits DP).
"""
from __future__ import annotations

from dataclasses import dataclass

# Ranks a layout may hold, far beyond any job's: code that walks every rank of a layout a file or a flag names
# (a plan lists each; a checkpoint's shards are looked up one by one) ran on for minutes past it.
LARGEST_WORLD = 65536


def _name(names: dict[str, str] | None, size: str) -> str:
    return (names or {}).get(size, size)


def check_sizes(sizes: dict[str, int], names: dict[str, str] | None = None) -> None:
    """Each parallel size must be an integer >= 1 (`check_sizes({"tp": 2, "pp": 1})`)."""
    for size, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{_name(names, size)} must be an integer >= 1, got {value!r}")
        if value < 1:
            raise ValueError(f"{_name(names, size)} must be >= 1, got {value}")


def data_parallel_size(world_size: int, tp: int, pp: int, ep: int = 1, names: dict[str, str] | None = None,
                       cp: int = 1) -> int:
    """DP of a world of `world_size` processes at (tp, pp, ep, cp), or raise naming what does not divide. The
    context-parallel ranks of one DP rank hold the same rows (each a part of every sequence), so they are not DP."""
    check_sizes({"tp": tp, "pp": pp, "ep": ep, "cp": cp}, names)
    model_parallel = tp * pp * cp
    sizes = " * ".join(_name(names, size) for size in ("tp", "pp", "cp") if size != "cp" or cp > 1)
    if world_size % model_parallel != 0:
        raise ValueError(f"{sizes} = {model_parallel} must divide the number of processes ({world_size})")
    dp = world_size // model_parallel
    if dp % ep != 0:
        raise ValueError(f"{_name(names, 'ep')}={ep} must divide the data-parallel size {dp} "
                         f"(processes {world_size} / tp*pp{'*cp' if cp > 1 else ''} {model_parallel})")
    return dp


def check_model_fit(model, tp: int, pp: int, ep: int = 1, names: dict[str, str] | None = None) -> None:
    """Refuse a layout the model cannot be split into. `model` has the sizes of `models.HFModelConfig`
    (num_heads, num_kv_heads, ffn_hidden_size, num_layers, num_experts)."""
    check_sizes({"tp": tp, "pp": pp, "ep": ep}, names)
    tp_name, pp_name, ep_name = (f"{_name(names, size)}={value}" for size, value in (("tp", tp), ("pp", pp), ("ep", ep)))
    if model.num_kv_heads % tp:
        raise ValueError(f"{tp_name} must divide the number of query groups (num_key_value_heads="
                         f"{model.num_kv_heads}) so that each rank holds whole query groups")
    if model.num_heads % tp:
        raise ValueError(f"{tp_name} must divide num_attention_heads={model.num_heads}")
    if model.ffn_hidden_size % tp:
        raise ValueError(f"{tp_name} must divide intermediate_size={model.ffn_hidden_size}")
    if model.num_layers % pp:
        raise ValueError(f"{pp_name} must divide num_hidden_layers={model.num_layers}")
    if ep > 1 and (not model.num_experts or model.num_experts % ep):
        raise ValueError(f"{ep_name} must divide the number of experts ({model.num_experts or 0})")


def check_rollout_tp(train_tp: int, rollout_tp: int, names: dict[str, str] | None = None) -> None:
    """The rollout TP must divide the training TP: each rollout rank takes whole consecutive training shards."""
    check_sizes({"rollout_tp": rollout_tp}, names)
    if train_tp % rollout_tp:
        choices = [d for d in range(1, train_tp + 1) if train_tp % d == 0]
        raise ValueError(
            f"{_name(names, 'rollout_tp')}={rollout_tp} must divide the training TP size "
            f"{_name(names, 'tp')}={train_tp} (one of {choices}): each rollout rank takes whole consecutive "
            "training shards"
        )


@dataclass(frozen=True)
class RankCoordinates:
    """Where a global rank sits in megatron's (TP, DP, PP[, EP]) grid: the one record of a rank's place, held by
    the live process's `ParallelLayout` (with the grid's sizes) and by the planner's `RankPlan`."""

    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int


@dataclass(frozen=True)
class ParallelLayout(RankCoordinates):
    """This process's coordinates (`RankCoordinates`) and the sizes of megatron's (TP, PP, DP[, EP]) grid."""

    tp: int
    pp: int
    dp: int
    ep: int
    world_size: int
    cp: int = 1  # context parallelism: ranks that split each sequence of the same rows
    cp_rank: int = 0
    vpp: int = 1  # virtual pipeline stages: the model chunks each pipeline rank runs (`models.chunks`)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def rank_coordinates(rank: int, tp: int, pp: int, dp: int, ep: int = 1) -> RankCoordinates:
    """Where global `rank` sits in megatron's (TP, DP, PP) grid."""
    return RankCoordinates(rank=rank, tp_rank=rank % tp, dp_rank=rank // tp % dp, pp_rank=rank // (tp * dp),
                           ep_rank=rank // tp % dp % ep)


@dataclass(frozen=True)
class RolloutCoordinates:
    """Where a rank sits in the rollout layout (TP = `rollout_tp`, pipeline stages folded into DP): the one record
    of a rank's place among the rollout replicas, for a training rank the HybridEngine regroups (colocated) and for
    a rank of the rollout ranks' own world (disaggregated, `RolePlacement.rollout_coordinates`: micro_dp 1).

    A *micro-DP group* is `micro_dp = tp // rollout_tp` consecutive ranks of a training TP group; their
    shards together make one rollout TP slice. A rollout TP group joins the ranks holding the same slice
    index of consecutive micro-DP groups; each such group is one rollout *replica*.
    """

    micro_dp: int
    rollout_tp_rank: int  # which rollout TP slice this rank holds
    replicas: int  # rollout replicas in the job (each generates its share of the prompts)
    replica: int  # this rank's replica
    leads_replica: bool  # rollout TP rank 0 of its replica: reports the replica's responses


def rollout_coordinates(rank: int, world_size: int, tp: int, rollout_tp: int) -> RolloutCoordinates:
    """Where `rank` of a world of `world_size` ranks at training TP `tp` sits in the rollout layout."""
    check_rollout_tp(tp, rollout_tp)
    micro_dp = tp // rollout_tp
    tp_rank = rank % tp
    return RolloutCoordinates(
        micro_dp=micro_dp,
        rollout_tp_rank=tp_rank // micro_dp,
        replicas=world_size // rollout_tp,
        replica=(rank // tp) * micro_dp + tp_rank % micro_dp,
        leads_replica=tp_rank // micro_dp == 0,
    )


@dataclass(frozen=True)
class RolePlacement:
    """A global rank's role in the job's split into training and rollout ranks: this process's `role` ("train" or
    "rollout") and the global ranks of both roles (`rollout_ranks` empty when colocated). `train_tp` and
    `rollout_tp` are parallel.tp and parallel.rollout_tp, which say who sends which weights to whom
    (`placement.weight_routes`)."""

    role: str
    global_rank: int
    global_size: int
    train_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]
    rollout_tp: int = 1
    train_tp: int = 1

    @property
    def disaggregated(self) -> bool:
        return bool(self.rollout_ranks)

    @property
    def role_ranks(self) -> tuple[int, ...]:
        """The global ranks of this process's role, in the order of its own world."""
        return self.train_ranks if self.role == "train" else self.rollout_ranks

    @property
    def rank_in_role(self) -> int:
        return self.role_ranks.index(self.global_rank)

    @property
    def role_size(self) -> int:
        return len(self.role_ranks)

    @property
    def replicas(self) -> int:
        """Rollout replicas on the rollout ranks (0 when colocated: the training ranks generate)."""
        return len(self.rollout_ranks) // self.rollout_tp

    def rollout_coordinates(self, global_rank: int) -> RolloutCoordinates:
        """Where rollout rank `global_rank` sits among the rollout replicas: they hold whole rollout TP slices,
        so the rollout ranks' world is a layout whose training TP is the rollout TP."""
        index = self.rollout_ranks.index(global_rank)
        return rollout_coordinates(index, len(self.rollout_ranks), self.rollout_tp, self.rollout_tp)


def rollout_vocab_rows(padded_vocab: int, vocab_size: int, part: int, parts: int) -> range:
    """Rows of the real vocabulary in rollout TP slice `part` of a padded embedding / output layer.

    Megatron pads at the end of the whole table, so only the last slices lose rows (`strip_vocab_padding`
    is the parts == 1 case).
    """
    per_part = padded_vocab // parts
    start = part * per_part
    return range(min(start, vocab_size), min(start + per_part, vocab_size))
