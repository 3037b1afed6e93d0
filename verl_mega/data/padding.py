"""Rows of token ids of different lengths -> one padded [rows, width] tensor and its attention mask.

The one place padding is written: prompts are left-padded (every prompt ends in the same column, so
generated tokens follow it directly), responses right-padded.
"""
from __future__ import annotations

from typing import Sequence

import torch

SIDES = ("left", "right")


def pad_rows(rows: Sequence[Sequence[int]], pad_token_id: int, *, side: str, width: int | None = None,
             dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of shape [len(rows), width] (default: the longest row); rows longer than `width` are cut
    on the far side from the padding, keeping their start (right padding) or their end (left padding).
    `dtype`: the ids' (per-token values other than ids, e.g. log-probs, pad the same way)."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    width = max((len(row) for row in rows), default=0) if width is None else width
    # Padded as Python lists, then one tensor each: a slice assignment per row costs a tensor op per row.
    ids, mask = [], []
    for row in rows:
        row = list(row)[-width:] if side == "left" and width else list(row)[:width]
        padding = width - len(row)
        ids.append([pad_token_id] * padding + row if side == "left" else row + [pad_token_id] * padding)
        mask.append([0] * padding + [1] * len(row) if side == "left" else [1] * len(row) + [0] * padding)
    shape = (len(rows), width)
    return torch.tensor(ids, dtype=dtype).reshape(shape), torch.tensor(mask, dtype=torch.long).reshape(shape)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only, so a left-padded row starts at position 0 (as HF numbers them)."""
    return (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
