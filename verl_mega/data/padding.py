"""Rows of token ids of different lengths -> one padded [rows, width] tensor and its attention mask.

The one place padding is written: prompts are left-padded (every prompt ends in the same column, so
generated tokens follow it directly), responses right-padded.
"""
from __future__ import annotations

from typing import Sequence

import torch

SIDES = ("left", "right")


def pad_rows(rows: Sequence[Sequence[int]], pad_token_id: int, *, side: str, width: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of shape [len(rows), width] (default: the longest row); rows longer than `width` are cut
    on the far side from the padding, keeping their start (right padding) or their end (left padding)."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    width = max((len(row) for row in rows), default=0) if width is None else width
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        row = list(row)[-width:] if side == "left" else list(row)[:width]
        if not row:
            continue
        columns = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[index, columns] = torch.tensor(row, dtype=torch.long)
        mask[index, columns] = 1
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, so a left-padded row starts at position 0 (as HF numbers them)."""
    return (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
