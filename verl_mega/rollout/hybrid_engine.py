"""3D-HybridEngine regroup: the actor's training shards -> the weights one rollout rank needs, streamed.

Training runs at (TP=t, PP=p, DP, EP); rollout at TP=t_g with t_g dividing t, pipeline stages folded into
data parallelism. A rank's rollout slice is the concatenation of k = t / t_g consecutive training TP
shards, so:

- the *micro-DP group* of a rank is the k consecutive ranks of its TP group holding those shards; the
  only all-gather runs inside it, and its rollout TP rank is `tp_rank // k`;
- pipeline stages are broadcast over the PP group from the stage that owns the layer (experts first over
  the EP group inside the owning stage), one megatron tensor at a time;
- names and layouts go through the family spec (`split_mcore_to_hf` on the k gathered shards gives the
  rollout TP slice of each HF tensor), so nothing here knows a family. The vocabulary padding megatron
  adds at the end of the table is dropped from the slices that hold it.

Extra memory is therefore bounded by one tensor's rollout slice (twice or three times that while a
q/k/v or gate/up layout is undone), never the model; `planner.plan` gives the bound per rank.

LoRA: a linear with adapters (`lora_a` [rank, in_local], `lora_b` [out_local, rank] beside its weight) is
merged on its owning rank, W_local + scale * B_local @ A_local, just before that one tensor enters the
regroup. Both factors' splits are the rank's own (column-parallel: B's rows with W's; row-parallel: A's
columns with W's), so the merge needs no communication, and the rollout engines receive plain weights.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from verl_mega.models.builder import checkpoint_tensors, unwrap_model
from verl_mega.models.hf_config import HFModelConfig
from verl_mega.models.lora import lora_modules, merged_weight
from verl_mega.models.sharding import TensorSlot, rank_slots, split_mcore_to_hf
from verl_mega.models.spec import SAME, FamilySpec, TensorRule, canonical_names
from verl_mega.parallel.layout import rollout_coordinates, rollout_vocab_rows
from verl_mega.parallel.shims import cuda_device_rewrite_paused
from verl_mega.parallel.state import current_layout

from .engine import WeightFeed
from .live_bytes import LiveBytes
from .quantization import quantized_stream


def transfer_order(hf_config: HFModelConfig, family: FamilySpec, pp: int, ep: int,
                   vpp: int = 1) -> Iterator[tuple[int, int, TensorSlot]]:
    """(owning stage, owning EP rank, slot) of every tensor the rollout needs, in the order all ranks walk."""
    for stage in range(pp):
        for ep_rank in range(ep):
            for slot in rank_slots(hf_config, family, stage, pp, ep_rank, ep, vpp=vpp):
                # The tied output layer is the embedding again; dense tensors are the same on every EP rank.
                if slot.is_tied_copy or (ep_rank > 0 and not slot.rule.per_expert):
                    continue
                yield stage, ep_rank, slot


def slice_is_gathered_shards(rule: TensorRule) -> bool:
    """True when the HF tensor's slice is just the megatron shards side by side (no layout to undo)."""
    return rule.row_merge is SAME and rule.fusion is None


@dataclass(frozen=True)
class _Adapter:
    """The LoRA factors of one targeted linear on this rank (live views of the training parameters)."""

    a: torch.Tensor  # [rank, in_local]
    b: torch.Tensor  # [out_local, rank]
    scale: float  # alpha / rank


@dataclass(frozen=True)
class _Peer:
    rank: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    tp_group: tuple[int, ...]
    shapes: dict  # global megatron name -> (shape, dtype) of this rank's shard


class HybridEngine:
    """Streams `(hf_name, tensor)` of this rank's rollout TP slice, from the actor's megatron model.

    Construct once per actor (it creates the micro-DP process groups, a collective call on every rank);
    call `stream()` on every rank at each transition and consume it fully. A yielded tensor is valid until
    the next one is requested and may be a view of the live training parameter: copy it, never write it.
    With `measure_peak`, `tracker.peak` is the measured most bytes the transition held at once (its buffers
    plus the tensor the consumer is loading).
    """

    def __init__(self, model: torch.nn.Module, hf_config: HFModelConfig, family: FamilySpec, rollout_tp: int = 1,
                 dtype: torch.dtype | None = None, measure_peak: bool = False, quantization: str = "none"):
        """`dtype`: what the rollout engine runs (default: the model's); the tensors are streamed in it.
        `quantization` (`rollout.quantization`): the linear weights are streamed quantized from their training
        dtype, each followed by its scales (`rollout.quantization.quantized_stream`).
        `measure_peak`: track the transition's live bytes (tests, benchmarks). Off in training: the tracking
        dispatch mode handles every op of the transition in Python, 40 % of a tiny model's transition.
        A model with LoRA adapters (`models.lora.apply_lora`) streams its adapted linears merged."""
        from megatron.core import parallel_state as ps

        self.hf_config, self.family, self.dtype, self.quantization = hf_config, family, dtype, quantization
        self.layout = current_layout()
        coordinates = rollout_coordinates(self.layout.rank, self.layout.world_size, self.layout.tp, rollout_tp)
        self.rollout_tp = rollout_tp
        self.micro_dp = coordinates.micro_dp
        self.rollout_tp_rank = coordinates.rollout_tp_rank
        self.tracker = LiveBytes() if measure_peak else None
        self._params, self._adapters = self._own_shards(model)

        me = _Peer(self.layout.rank, self.layout.tp_rank, self.layout.pp_rank, self.layout.ep_rank,
                   tuple(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())),
                   {name: (tuple(p.shape), p.dtype) for name, p in self._params.items()})
        peers: list[_Peer] = [None] * self.layout.world_size  # type: ignore[list-item]
        dist.all_gather_object(peers, me)
        self._shapes = {name: meta for peer in peers for name, meta in peer.shapes.items()}
        self._pp_group, self._stage_src = self._sources(ps.get_pipeline_model_parallel_group(), peers, "pp_rank")
        self._ep_group, self._expert_src = None, {}
        if self.layout.ep > 1:
            self._check_expert_tp_matches(ps)
            self._ep_group, self._expert_src = self._sources(ps.get_expert_model_parallel_group(), peers, "ep_rank")
        self._micro_dp_group = self._micro_dp_groups(peers, ps)

    # --- set-up -------------------------------------------------------------------------------------

    def _own_shards(self, model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, _Adapter]]:
        """This rank's shards by global megatron name, and the adapters of those that have LoRA factors."""
        params = checkpoint_tensors(unwrap_model(model))
        by_local = {canonical: params[name] for name, canonical in canonical_names(params).items()}
        # A linear's name is the same in the local and the canonical spelling (only norms differ).
        scales = {info.name: info.scale for info in lora_modules(model)}
        layout = self.layout
        shards, adapters = {}, {}
        for slot in rank_slots(self.hf_config, self.family, layout.pp_rank, layout.pp, layout.ep_rank, layout.ep,
                               vpp=layout.vpp):
            if slot.is_tied_copy:
                continue
            if slot.local_name not in by_local:
                raise ValueError(
                    f"the actor model on rank {layout.rank} has no parameter '{slot.local_name}' that the "
                    f"{self.family.name} spec expects at pp_rank {layout.pp_rank}: was it built from this config "
                    f"at tp={layout.tp}, pp={layout.pp}, vpp={layout.vpp}, ep={layout.ep}?"
                )
            shards[slot.global_name] = by_local[slot.local_name].detach()
            module = slot.local_name.removesuffix(".weight")
            if slot.local_name.endswith(".weight") and module in scales:
                adapters[slot.global_name] = _Adapter(by_local[module + ".lora_a"].detach(),
                                                      by_local[module + ".lora_b"].detach(), scales[module])
        return shards, adapters

    @staticmethod
    def _sources(group, peers: list[_Peer], coordinate: str):
        """The group and, for each value of `coordinate`, the global rank in it holding that value."""
        members = dist.get_process_group_ranks(group)
        return group, {getattr(peers[rank], coordinate): rank for rank in members}

    def _micro_dp_groups(self, peers: list[_Peer], ps):
        if self.micro_dp == 1:
            return None
        if self.micro_dp == self.layout.tp:
            mine = ps.get_tensor_model_parallel_group()
        else:
            tp_groups = sorted({tuple(sorted(peer.tp_group, key=lambda r: peers[r].tp_rank)) for peer in peers})
            chunks = [list(group[i:i + self.micro_dp])
                      for group in tp_groups for i in range(0, len(group), self.micro_dp)]
            mine, _ = dist.new_subgroups_by_enumeration(chunks, backend=dist.get_backend())
        # The gathered shards are placed by group rank, so it must follow the TP rank.
        position = dist.get_group_rank(mine, self.layout.rank)
        if position != self.layout.tp_rank % self.micro_dp:
            raise RuntimeError(
                f"rank {self.layout.rank} (tp_rank {self.layout.tp_rank}) is number {position} in its micro-DP group, "
                f"expected {self.layout.tp_rank % self.micro_dp}: TP ranks are not ordered like global ranks"
            )
        return mine

    def _check_expert_tp_matches(self, ps) -> None:
        expert_tp = dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group())
        dense_tp = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
        if sorted(expert_tp) != sorted(dense_tp):
            raise ValueError(
                f"expert tensor parallelism differs from dense TP on rank {self.layout.rank} (expert TP ranks "
                f"{expert_tp}, TP ranks {dense_tp}): the HybridEngine needs expert_tensor_parallel_size == tp"
            )

    # --- the transition ----------------------------------------------------------------------------

    def stream(self, quantized: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor of this rank's rollout slice (vocabulary padding removed), one at a time, in the rollout
        dtype or quantized (`quantized=False`: none quantized, for the first transition's probe). The cast and
        the quantization run after the collectives: they move the training shards as they are, and the cast copy
        is one tensor at a time (same dtype: the tensor itself, no copy)."""
        return quantized_stream(self._slices(), self.quantization if quantized else "none", self.dtype)

    def _slices(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF tensor of this rank's rollout slice in the training dtype."""
        layout = self.layout
        tracking = self.tracker if self.tracker is not None else contextlib.nullcontext()
        if self.tracker is not None:
            self.tracker.reset_peak()
        for stage, ep_rank, slot in transfer_order(self.hf_config, self.family, layout.pp, layout.ep, layout.vpp):
            # Buffers follow the parameters' device, so the CPU shims' per-op hook has nothing to rewrite here.
            with tracking, cuda_device_rewrite_paused():
                parts = [(name, self._real_vocab_rows(slot, tensor))
                         for name, tensor in self._hf_slices(slot, stage, ep_rank)]
            while parts:
                yield parts.pop(0)

    def _shard_at_this_rank(self, slot: TensorSlot, stage: int, ep_rank: int,
                            into: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's TP shard of the tensor: its own, or received (into `into` if given) from the stage /
        EP rank owning it. Owners take part as the broadcast source, so every rank walks the same collectives.
        """
        name = slot.global_name
        shard = self._params.get(name)
        if name in self._adapters:
            adapter = self._adapters[name]
            shard = merged_weight(shard, adapter.a, adapter.b, adapter.scale)
        if shard is None and (self.layout.pp > 1 or (slot.rule.per_expert and self.layout.ep > 1)):
            shard = into if into is not None else self._empty(name)
        if slot.rule.per_expert and self.layout.ep > 1 and self.layout.pp_rank == stage:
            dist.broadcast(shard, self._expert_src[ep_rank], group=self._ep_group)
        if self.layout.pp > 1:
            dist.broadcast(shard, self._stage_src[stage], group=self._pp_group)
        return shard

    def _hf_slices(self, slot: TensorSlot, stage: int, ep_rank: int) -> list[tuple[str, torch.Tensor]]:
        """The rollout slice of each HF tensor, from the k consecutive training shards of the micro-DP group."""
        rule = slot.rule
        # SAME layout (embedding, LM head, o_proj, down_proj): the HF slice is the shards concatenated along
        # tp_dim, so one shard is it already, and along dim 0 the shards are received and gathered straight
        # into it: the slice is the only buffer.
        direct = slice_is_gathered_shards(rule)
        if rule.tp_dim is None or self._micro_dp_group is None:
            shard = self._shard_at_this_rank(slot, stage, ep_rank)
            return [(slot.hf_names[0], shard)] if direct else split_mcore_to_hf(slot, self.hf_config, [shard])
        if direct and rule.tp_dim == 0:
            shape, dtype = self._shapes[slot.global_name]
            joined = torch.empty((self.micro_dp * shape[0], *shape[1:]), dtype=dtype, device=self._device)
            chunks = list(joined.chunk(self.micro_dp))
            shard = self._shard_at_this_rank(slot, stage, ep_rank, into=chunks[self.layout.tp_rank % self.micro_dp])
            dist.all_gather(chunks, shard, group=self._micro_dp_group)
            return [(slot.hf_names[0], joined)]
        shard = self._shard_at_this_rank(slot, stage, ep_rank)
        gathered = [torch.empty_like(shard) for _ in range(self.micro_dp)]
        dist.all_gather(gathered, shard.contiguous(), group=self._micro_dp_group)
        del shard
        return split_mcore_to_hf(slot, self.hf_config, gathered)

    @property
    def feed(self) -> WeightFeed:
        """How `stream()` lays out its tensors on this rank, for the rollout engine that loads them."""
        slots = transfer_order(self.hf_config, self.family, self.layout.pp, self.layout.ep,
                               self.layout.vpp)
        vocab_slot = next(slot for _, _, slot in slots if slot.rule.vocab)
        padded_vocab = self._shapes[vocab_slot.global_name][0][0] * self.layout.tp
        return WeightFeed(self.rollout_tp, self.rollout_tp_rank, padded_vocab, self.hf_config.vocab_size)

    def _real_vocab_rows(self, slot: TensorSlot, tensor: torch.Tensor) -> torch.Tensor:
        if not slot.rule.vocab:
            return tensor
        padded_vocab = self._shapes[slot.global_name][0][0] * self.layout.tp
        rows = rollout_vocab_rows(padded_vocab, self.hf_config.vocab_size, self.rollout_tp_rank, self.rollout_tp)
        return tensor[: len(rows)]

    def _empty(self, name: str) -> torch.Tensor:
        shape, dtype = self._shapes[name]
        return torch.empty(shape, dtype=dtype, device=self._device)

    @property
    def _device(self) -> torch.device:
        return next(iter(self._params.values())).device
