"""Walk a family spec over one rank's part of the model: which megatron tensors, from which HF tensors.

Shared by the converters (HF -> shards, shards -> HF), the HybridEngine and the exporter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .chunks import chunk_prefix
from .hf_config import HFModelConfig
from .spec import EXPERT, LAYER, LM_HEAD, FamilySpec, TensorRule


@dataclass(frozen=True)
class TensorSlot:
    """One megatron tensor instance: its rule, global layer/expert, and names (global and rank-local)."""

    rule: TensorRule
    layer: int | None
    expert: int | None
    local_name: str  # layer/expert numbered within this PP stage / EP rank, as megatron's modules are
    hf_names: tuple[str, ...]

    @property
    def is_tied_copy(self) -> bool:
        """The last stage's copy of the tied embedding; exports skip it."""
        return self.local_name.endswith(LM_HEAD) and self.rule.mcore != LM_HEAD

    @property
    def global_name(self) -> str:
        return _fill(self.rule.mcore, self.layer, self.expert)


def _fill(template: str, layer: int | None, expert: int | None) -> str:
    return template.replace(LAYER, str(layer)).replace(EXPERT, str(expert))


def stage_layers(hf_config: HFModelConfig, pp_rank: int, pp: int, vpp: int = 1, chunk: int = 0) -> range:
    """The (global, 0-based) layers of pipeline rank `pp_rank`'s model chunk `chunk`: in megatron's interleaved
    order, chunk c of rank r runs the (c x pp + r)-th of pp x vpp equal runs of layers (one chunk at vpp=1)."""
    per_chunk = hf_config.num_layers // (pp * vpp)
    first = (chunk * pp + pp_rank) * per_chunk
    return range(first, first + per_chunk)


def rank_slots(hf_config: HFModelConfig, family: FamilySpec, pp_rank: int = 0, pp: int = 1, ep_rank: int = 0,
               ep: int = 1, head_rules: Sequence[TensorRule] | None = None, vpp: int = 1) -> Iterator[TensorSlot]:
    """Every megatron tensor a rank at (pp_rank, ep_rank) holds, in a stable order; `head_rules` replace the
    LM head (see `FamilySpec.active_rules`). Under `vpp` virtual pipeline stages the rank's model is its chunks
    (`chunks.StageChunks`), each tensor named `chunks.C.` + its name in chunk C."""
    experts_per_rank = (hf_config.num_experts or 1) // ep
    experts = range(ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank)
    tied_copy = pp > 1 and hf_config.tie_word_embeddings and head_rules is None
    for chunk in range(vpp):
        layers = stage_layers(hf_config, pp_rank, pp, vpp, chunk)
        prefix = chunk_prefix(chunk) if vpp > 1 else ""
        first, last = pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == vpp - 1
        for rule in family.active_rules(hf_config, head_rules):
            if not rule.per_layer:
                if rule.mcore.startswith("embedding."):
                    if first:
                        yield TensorSlot(rule, None, None, prefix + rule.mcore, rule.hf)
                    if last and tied_copy:
                        # The last stage keeps its own copy of the tied embedding as the output layer.
                        yield TensorSlot(rule, None, None, prefix + LM_HEAD, rule.hf)
                elif last:
                    yield TensorSlot(rule, None, None, prefix + rule.mcore, rule.hf)
                continue
            for layer in layers:
                if not family.rule_in_layer(rule, hf_config, layer):
                    continue
                for expert in (experts if rule.per_expert else [None]):
                    local_expert = None if expert is None else expert - experts.start
                    yield TensorSlot(
                        rule, layer, expert, prefix + _fill(rule.mcore, layer - layers.start, local_expert),
                        tuple(_fill(name, layer, expert) for name in rule.hf),
                    )


def fp32_hf_names(hf_config: HFModelConfig, family: FamilySpec) -> set[str]:
    """The HF tensors stored in fp32 whatever the model's dtype (`TensorRule.fp32`)."""
    return {name for slot in rank_slots(hf_config, family) if slot.rule.fp32 for name in slot.hf_names}


def tp_part(tensor: torch.Tensor, dim: int | None, part: int, parts: int) -> torch.Tensor:
    if dim is None or parts == 1:
        return tensor
    return tensor.chunk(parts, dim=dim)[part]


@dataclass(frozen=True)
class HFRows:
    """Rows [start, start + rows) of HF tensor `name`, restricted to column part `part` of `parts` equal parts
    (all columns when `parts` is 1); rows past the tensor's end are zeros (megatron's padded vocabulary)."""

    name: str
    start: int
    rows: int
    part: int = 0
    parts: int = 1


def shard_pieces(slot: TensorSlot, hf_config: HFModelConfig, shape_of, tp_rank: int, tp: int,
                 padded_vocab: int) -> list[HFRows] | None:
    """This TP rank's shard of a megatron tensor as the HF row ranges it is made of, top to bottom, or None
    where a fused HF tensor must be unfused first. `shape_of(hf_name)` gives an HF tensor's shape."""
    rule = slot.rule
    if rule.fusion is not None or any(not shape_of(name) for name in slot.hf_names):
        return None
    if rule.tp_dim == 0:
        part_rows = [(padded_vocab if rule.vocab else shape_of(name)[0]) // tp for name in slot.hf_names]
        first_row, part, parts = [tp_rank * rows for rows in part_rows], 0, 1
    else:
        part_rows = [shape_of(name)[0] for name in slot.hf_names]
        first_row = [0] * len(part_rows)
        part, parts = (tp_rank, tp) if rule.tp_dim == 1 else (0, 1)
    blocks = sorted(rule.row_merge.blocks(part_rows, hf_config), key=lambda b: b.merged_row)
    return [HFRows(slot.hf_names[b.source], first_row[b.source] + b.source_row, b.rows, part, parts)
            for b in blocks]


def merge_hf_to_mcore(slot: TensorSlot, hf_config: HFModelConfig, reader, tp_rank: int, tp: int,
                      padded_vocab: int) -> torch.Tensor:
    """This TP rank's shard of a megatron tensor, reading only its slices of the HF sources.

    `reader` is a `SafetensorsReader`. Row-split sources are read straight into their blocks of the
    merged tensor (no intermediate copies); fused HF tensors are read whole, unfused, then sliced.
    """
    rule = slot.rule
    if rule.fusion is not None:
        fused = reader.read(slot.hf_names[0])
        sources = [tp_part(t, rule.tp_dim, tp_rank, tp) for t in rule.fusion.unfuse(fused, hf_config)]
        return rule.row_merge.merge(sources, hf_config)
    if rule.tp_dim is None:
        return rule.row_merge.merge([reader.read(name) for name in slot.hf_names], hf_config)
    if rule.tp_dim == 1:
        return rule.row_merge.merge([reader.read_part(name, 1, tp_rank, tp) for name in slot.hf_names], hf_config)
    pieces = shard_pieces(slot, hf_config, reader.shape, tp_rank, tp, padded_vocab)
    first = slot.hf_names[0]
    merged = torch.empty((sum(p.rows for p in pieces), *reader.shape(first)[1:]), dtype=reader.dtype(first))
    row = 0
    for piece in pieces:
        reader.read_rows(piece.name, piece.start, piece.rows, out=merged[row:row + piece.rows])
        row += piece.rows
    return merged


def split_mcore_to_hf(slot: TensorSlot, hf_config: HFModelConfig, shards: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """HF tensors from consecutive TP shards of one megatron tensor (all of them: full HF tensors).

    With a subset of consecutive shards the result is the matching TP slice of each HF tensor (the
    HybridEngine's rollout layout). Vocabulary padding is kept; `strip_vocab_padding` removes it.
    """
    rule = slot.rule
    if rule.tp_dim is None:
        parts = rule.row_merge.split(shards[0], hf_config)
    else:
        per_shard = [rule.row_merge.split(shard, hf_config) for shard in shards]
        parts = [torch.cat([pieces[i] for pieces in per_shard], dim=rule.tp_dim) for i in range(len(per_shard[0]))]
    if rule.fusion is not None:
        return [(slot.hf_names[0], rule.fusion.fuse(parts))]
    return list(zip(slot.hf_names, parts))


def strip_vocab_padding(rule: TensorRule, tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return tensor[:vocab_size] if rule.vocab else tensor
