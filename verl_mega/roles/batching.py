"""Batches as the megatron roles see them: data-parallel slices, micro-batches, attention masks, loss weights.

A batch is a dict of tensors sharing the batch dimension: `input_ids`, `attention_mask`, `position_ids` [B, L]
(prompt left-padded, response right-padded, so each row's valid tokens are contiguous), `responses` and
`response_mask` [B, R] (the last R columns of `input_ids`), plus per-token training inputs
(`old_log_probs`, `advantages`, `ref_log_probs`, `values`, `returns`) [B, R], and for routing replay the
rollout's `routed_experts` [B, L, moe_layers, top_k].

Contract with callers: every rank passes the same global batch; the role takes its data-parallel slice
(`dp_slice`) and returns results for the whole batch (gathered over DP), so trainers stay layout-agnostic.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from verl_mega.algorithms import agg_units
from verl_mega.parallel.state import device

from .routing_replay import NOT_RECORDED

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


# Per-column tensors [B, L, ...] (`routed_experts`: see roles.routing_replay), sliced as the tokens are.
SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids", "routed_experts")
_PADDING_FILL = {"routed_experts": NOT_RECORDED}  # the others pad with 0


def _used_columns(attention_mask: torch.Tensor, response_length: int) -> list[tuple[int, int]]:
    """Per row, the columns [first, end) that a forward over it needs: from its first prompt token (at most the
    last prompt column, whose output predicts the first response token) to its last response token (at least
    one response column, so that every micro-batch keeps a response window)."""
    length = attention_mask.shape[1]
    prompt_length = length - response_length
    valid = attention_mask.bool()
    columns = torch.arange(length)
    first = torch.where(valid, columns, length).amin(dim=1).clamp(max=prompt_length - 1)
    end = (torch.where(valid, columns, -1).amax(dim=1) + 1).clamp(min=prompt_length + 1)
    return list(zip(first.tolist(), end.tolist()))


def trim_padding(micro_batch: Batch) -> Batch:
    """The micro-batch without the columns that are padding in every row: left of the (left-padded) prompts,
    right of the (right-padded) responses. The response window stays the last columns of `input_ids`, and the
    per-token [b, R] tensors lose the same right columns, so they stay aligned with it. Attention never sees
    padding keys and RoPE depends on position differences only, so the outputs are the same."""
    response_length = micro_batch["responses"].shape[1]
    spans = _used_columns(micro_batch["attention_mask"], response_length)
    first, end = min(span[0] for span in spans), max(span[1] for span in spans)
    length = micro_batch["attention_mask"].shape[1]
    kept_response = end - (length - response_length)
    trimmed = {}
    for key, value in micro_batch.items():
        if key in SEQUENCE_KEYS:
            trimmed[key] = value[:, first:end]
        elif value.dim() >= 2:
            trimmed[key] = value[:, :kept_response]
        else:
            trimmed[key] = value
    return trimmed


def token_budget_spans(attention_mask: torch.Tensor, response_length: int, max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [start, stop) whose trimmed micro-batch (rows x trimmed width) holds at most
    `max_tokens` tokens, padding included (what the forward computes); a row wider than that goes alone."""
    spans, start, first, end = [], 0, None, None
    for row, (row_first, row_end) in enumerate(_used_columns(attention_mask, response_length)):
        if first is not None:
            grown_first, grown_end = min(first, row_first), max(end, row_end)
            if (row - start + 1) * (grown_end - grown_first) <= max_tokens:
                first, end = grown_first, grown_end
                continue
            spans.append((start, row))
        start, first, end = row, row_first, row_end
    if first is not None:
        spans.append((start, attention_mask.shape[0]))
    return spans


def micro_batches(batch: Batch, micro_batch_size: int, max_tokens: int = 0, trim: bool = True,
                  columns_multiple_of: int = 1) -> list[Batch]:
    """One rank's micro-batches: `micro_batch_size` rows each or, with `max_tokens`, as many consecutive rows as
    fit that many tokens after trimming; each trimmed of all-padding columns unless `trim` is False (pipeline
    stages that can only exchange one fixed shape), then left-padded to a multiple of `columns_multiple_of`
    columns (sequence parallelism splits the sequence evenly over the TP ranks)."""
    if max_tokens:
        if not trim:
            raise ValueError("a token budget per micro-batch needs micro-batches of varying shape, which this "
                             "model's pipeline cannot exchange: unset max_tokens_per_micro_batch")
        spans = token_budget_spans(batch["attention_mask"], batch["responses"].shape[1], max_tokens)
        pieces = [select_rows(batch, start, stop) for start, stop in spans]
    else:
        pieces = list(split_rows(batch, micro_batch_size, "micro_batch_size"))
    if trim:
        pieces = [trim_padding(piece) for piece in pieces]
    return [pad_columns_to_multiple(piece, columns_multiple_of) for piece in pieces]


def pad_columns_to_multiple(micro_batch: Batch, multiple: int) -> Batch:
    """The micro-batch with padding columns added on the left of its per-column tensors (before the left-padded
    prompts, so the response window stays the last columns) up to a multiple of `multiple` columns: no token,
    no position, no recorded route there."""
    missing = -micro_batch["input_ids"].shape[1] % multiple
    if not missing:
        return micro_batch
    padded = dict(micro_batch)
    for key in SEQUENCE_KEYS:
        if key in micro_batch:
            value = micro_batch[key]
            fill = torch.full((value.shape[0], missing, *value.shape[2:]), _PADDING_FILL.get(key, 0), dtype=value.dtype)
            padded[key] = torch.cat([fill, value], dim=1)
    return padded


def pad_response_columns(per_token: torch.Tensor, response_length: int) -> torch.Tensor:
    """A trimmed micro-batch's [b, r] result back to the batch's [b, R]; the dropped columns were padding."""
    return torch.nn.functional.pad(per_token, (0, response_length - per_token.shape[1]))


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
