"""Batches as the megatron roles see them: data-parallel slices, micro-batches, attention masks, loss weights.

A batch is a dict of tensors sharing the batch dimension: `input_ids`, `attention_mask`, `position_ids` [B, L]
(prompt left-padded, response right-padded, so each row's valid tokens are contiguous), `responses` and
`response_mask` [B, R] (the last R columns of `input_ids`), plus per-token training inputs
(`old_log_probs`, `advantages`, `ref_log_prob`, `values`, `returns`) [B, R].

Contract with callers: every rank passes the same global batch; the role takes its data-parallel slice
(`dp_slice`) and returns results for the whole batch (gathered over DP), so trainers stay layout-agnostic.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from verl_mega.algorithms import agg_units
from verl_mega.parallel.state import device

Batch = dict[str, torch.Tensor]


def batch_size(batch: Batch) -> int:
    return batch["input_ids"].shape[0]


def select_rows(batch: Batch, start: int, stop: int) -> Batch:
    return {key: value[start:stop] for key, value in batch.items()}


def dp_slice(batch: Batch, dp_rank: int, dp: int) -> Batch:
    """The contiguous rows `dp_rank` of `dp` processes: gathering the slices in rank order restores the batch."""
    size = batch_size(batch)
    if size % dp:
        raise ValueError(f"batch size {size} must be divisible by the data-parallel size {dp}")
    per_rank = size // dp
    return select_rows(batch, dp_rank * per_rank, (dp_rank + 1) * per_rank)


def split_rows(batch: Batch, rows: int, what: str) -> Iterator[Batch]:
    """Consecutive pieces of `rows` rows; `what` names the setting to change when they do not divide."""
    size = batch_size(batch)
    if rows < 1 or size % rows:
        raise ValueError(f"{what}={rows} must be >= 1 and divide the batch of {size} rows it splits")
    for start in range(0, size, rows):
        yield select_rows(batch, start, start + rows)


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's [B, 1, L, L] boolean mask (True = may not attend): causal, and no key that is padding.

    megatron's local DotProductAttention uses a given mask instead of (not on top of) its causal one,
    so the causal part must be in it. Padding queries attend to nothing; their outputs are never used.
    RoPE in megatron numbers positions 0..L-1 regardless of `position_ids`; attention scores depend only on
    position differences, which equal HF's cumsum(attention_mask) - 1 numbering when valid tokens are
    contiguous (checked).
    """
    valid = attention_mask.bool()
    starts = (valid[:, 1:] & ~valid[:, :-1]).sum(dim=1) + valid[:, 0].long()
    if (starts > 1).any():
        rows = torch.nonzero(starts > 1).flatten().tolist()
        raise ValueError(f"attention_mask rows {rows[:5]} have gaps: valid tokens must be contiguous per row "
                         "(left-padded prompt followed by the right-padded response)")
    length = attention_mask.shape[1]
    future = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).triu(1)
    return (future | ~valid[:, None, :])[:, None]


def response_window(logits_or_hidden: torch.Tensor, response_length: int) -> torch.Tensor:
    """The outputs that predict the response tokens: positions L-R-1 .. L-2 of [B, L, ...]."""
    return logits_or_hidden[:, -response_length - 1:-1]


def global_agg_units(response_mask: torch.Tensor, loss_agg_mode: str, dp_group) -> torch.Tensor:
    """Units (see `agg_units`) of this rank's mini-batch summed over data parallelism."""
    # On the collective backend's device: NCCL reduces CUDA tensors only, and batches arrive on the host.
    units = agg_units(response_mask, loss_agg_mode).reshape(1).to(device())
    dist.all_reduce(units, group=dp_group)
    return units[0]
