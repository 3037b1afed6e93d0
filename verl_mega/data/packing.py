"""Padding-free packing of a micro-batch's rows into one THD row (transformer-engine's packed attention).

In the padded layout [B, L] each row's valid tokens are one contiguous run (a left-padded prompt followed by
its right-padded response). Packed, the runs sit back to back in a single row [1, T]; each run may be padded
at its end to a multiple of `multiple_of` (sequence parallelism splits the packed row over tensor-parallel
ranks). `cu_seqlens` holds the runs' boundaries without that padding, `cu_seqlens_padded` with it, as
megatron's `PackedSeqParams` wants them; positions restart at 0 in every run, as `padding.position_ids`
numbers a padded row. `pack` and `unpack` move any per-token tensor (ids, masks, log-probs, values) between
the two layouts; unpacking writes `fill` where the padded layout has padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """Where each padded row's run lies in the packed row; built by `pack_layout`."""

    row_starts: torch.Tensor  # [B] long: the run's first column in the padded layout
    lengths: torch.Tensor  # [B] long: the run's token count
    cu_seqlens: torch.Tensor  # [B + 1] int32: the runs' boundaries in the packed row, end padding excluded
    cu_seqlens_padded: torch.Tensor  # [B + 1] int32: the same with each run padded to `multiple_of`
    width: int  # L, the padded layout's row width

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def total(self) -> int:
        """T: the packed row's length, end padding included."""
        return int(self.cu_seqlens_padded[-1])

    @property
    def max_seqlen(self) -> int:
        """The longest padded run (what the attention kernel sizes its work by)."""
        return int((self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).max()) if self.rows else 0

    def position_ids(self) -> torch.Tensor:
        """[1, T]: 0, 1, ... within every run (its end padding continues the count)."""
        starts = torch.repeat_interleave(self.cu_seqlens_padded[:-1].long(), self._padded_lengths())
        return (torch.arange(self.total) - starts).unsqueeze(0)

    def _padded_lengths(self) -> torch.Tensor:
        return (self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).long()

    def _indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat index into [B * L], index into [T]) of every valid token, in the same order."""
        rows = torch.repeat_interleave(torch.arange(self.rows), self.lengths)
        offset = torch.arange(len(rows)) - torch.repeat_interleave(self.cu_seqlens[:-1].long(), self.lengths)
        padded = rows * self.width + self.row_starts[rows] + offset
        packed = self.cu_seqlens_padded[:-1].long()[rows] + offset
        return padded, packed


def pack_layout(attention_mask: torch.Tensor, multiple_of: int = 1) -> PackedRows:
    """The packing of the rows of `attention_mask` [B, L]; every row's valid tokens must be contiguous."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [rows, width], got shape {tuple(attention_mask.shape)}")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    valid = attention_mask.bool().cpu()
    rows, width = valid.shape
    lengths = valid.sum(dim=1)
    columns = torch.arange(width)
    row_starts = torch.where(valid, columns, width).amin(dim=1) if width else torch.zeros(rows, dtype=torch.long)
    row_starts = torch.where(lengths > 0, row_starts, 0)
    last = torch.where(valid, columns, -1).amax(dim=1) if width else torch.full((rows,), -1)
    gapped = (lengths > 0) & (last - row_starts + 1 != lengths)
    if gapped.any():
        raise ValueError(f"attention_mask rows {gapped.nonzero().flatten().tolist()[:5]} have gaps: packing needs "
                         "each row's valid tokens contiguous")
    padded_lengths = (lengths + multiple_of - 1) // multiple_of * multiple_of
    zero = torch.zeros(1, dtype=torch.long)
    return PackedRows(
        row_starts=row_starts.long(), lengths=lengths.long(),
        cu_seqlens=torch.cat([zero, lengths.cumsum(0)]).to(torch.int32),
        cu_seqlens_padded=torch.cat([zero, padded_lengths.cumsum(0)]).to(torch.int32),
        width=width,
    )


def pack(values: torch.Tensor, layout: PackedRows, fill=0) -> torch.Tensor:
    """[B, L, ...] in the padded layout -> [1, T, ...] packed; the runs' end padding holds `fill`."""
    if tuple(values.shape[:2]) != (layout.rows, layout.width):
        raise ValueError(f"values of shape {tuple(values.shape)} do not match the packed rows "
                         f"[{layout.rows}, {layout.width}, ...]")
    padded, packed = (index.to(values.device) for index in layout._indices())
    out = values.new_full((layout.total, *values.shape[2:]), fill)
    out = out.index_put((packed,), values.reshape(-1, *values.shape[2:])[padded])
    return out.unsqueeze(0)


def unpack(packed_values: torch.Tensor, layout: PackedRows, fill=0) -> torch.Tensor:
    """[1, T, ...] packed -> [B, L, ...] in the padded layout, `fill` where it has padding. Differentiable."""
    if packed_values.shape[0] != 1 or packed_values.shape[1] != layout.total:
        raise ValueError(f"packed values of shape {tuple(packed_values.shape)} do not match the packed row "
                         f"[1, {layout.total}, ...]")
    padded, packed = (index.to(packed_values.device) for index in layout._indices())
    rest = packed_values.shape[2:]
    out = packed_values.new_full((layout.rows * layout.width, *rest), fill)
    out = out.index_put((padded,), packed_values[0, packed])
    return out.reshape(layout.rows, layout.width, *rest)
