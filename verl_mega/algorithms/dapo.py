"""DAPO's data-side parts (Yu et al. 2025) as pure tensor functions: dynamic sampling's group filter, the soft
overlong punishment and the detection of truncated responses for overlong filtering.

Rows come in groups: the `group_size` responses to one prompt are consecutive rows (prompt-major, as the
rollout engines return them). The trainer runs the generation rounds; `GroupFilter` decides what each round
keeps, so the filter's whole logic is testable on hand-built scores.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def constant_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """[G] bool: whether every response of a group has the same value (no group-relative signal: GRPO's
    advantages of such a group are all zero). `values` [G * group_size], consecutive rows per group."""
    if values.dim() != 1 or values.numel() % group_size:
        raise ValueError(f"values of shape {tuple(values.shape)} do not split into groups of {group_size}")
    grouped = values.reshape(-1, group_size)
    # Exact equality, as the groups' standard deviation being 0 means; NaN equals nothing, so a group holding
    # one is kept and reaches the trainer's non-finite check.
    return (grouped == grouped[:, :1]).all(dim=-1)


class GroupFilter:
    """Dynamic sampling's bookkeeping over one step's generation rounds.

    Each round's groups are kept unless `drop_constant` and their values are all equal, in order, until
    `target_groups` are kept (the surplus of the last round is cut). `max_rounds` bounds the rounds (0: no
    bound, as verl's `max_num_gen_batches`); the filter is `done` once full or out of rounds."""

    def __init__(self, target_groups: int, group_size: int, max_rounds: int, drop_constant: bool = True):
        if target_groups < 1 or group_size < 1 or max_rounds < 0:
            raise ValueError(f"target_groups={target_groups} and group_size={group_size} must be >= 1, "
                             f"max_rounds={max_rounds} >= 0")
        self.target_groups, self.group_size = target_groups, group_size
        self.max_rounds, self.drop_constant = max_rounds, drop_constant
        self.rounds = self.kept = self.dropped = 0

    def keep(self, values: torch.Tensor) -> torch.Tensor:
        """[G] bool: the groups of this round's `values` [G * group_size] that the batch keeps."""
        if self.done:
            raise RuntimeError("the filter is done: no further round is needed or allowed")
        informative = ~constant_groups(values, self.group_size) if self.drop_constant else \
            torch.ones(values.numel() // self.group_size, dtype=torch.bool)
        room = self.target_groups - self.kept
        keep = informative & (informative.cumsum(dim=0) <= room)
        self.rounds += 1
        self.kept += int(keep.sum())
        self.dropped += int((~informative).sum())
        return keep

    @property
    def full(self) -> bool:
        return self.kept == self.target_groups

    @property
    def exhausted(self) -> bool:
        """Out of rounds before the batch is full."""
        return not self.full and 0 < self.max_rounds <= self.rounds

    @property
    def done(self) -> bool:
        return self.full or self.exhausted

    def metrics(self) -> dict[str, float]:
        return {"filter_groups/kept_groups": self.kept, "filter_groups/dropped_groups": self.dropped,
                "filter_groups/gen_rounds": self.rounds}


class BatchNotFilled(Exception):
    """Dynamic sampling ran out of rounds and was told to stop rather than train on a partial batch."""


EXHAUSTED_POLICIES = ("stop", "train")


def trainable_groups(groups: GroupFilter, on_exhausted: str, mini_batch_sizes: Sequence[int]) -> int:
    """How many of the kept groups (the first ones) a step trains on: all of a full batch; out of rounds, under
    "stop" none (raises BatchNotFilled), under "train" those filling whole mini-batches."""
    if on_exhausted not in EXHAUSTED_POLICIES:
        raise ValueError(f"on_exhausted must be one of {EXHAUSTED_POLICIES}, got {on_exhausted!r}")
    if groups.full:
        return groups.kept
    if on_exhausted == "stop":
        raise BatchNotFilled(f"kept {groups.kept} of {groups.target_groups} groups in {groups.rounds} rounds")
    return groups_filling_mini_batches(groups.kept, groups.group_size, mini_batch_sizes)


def groups_filling_mini_batches(groups: int, group_size: int, mini_batch_sizes: Sequence[int]) -> int:
    """The most of `groups` whose rows split into whole mini-batches of every size in `mini_batch_sizes` (a
    partial batch must still split over the data-parallel ranks and micro-batches, which each mini-batch does);
    0 when not even one mini-batch is filled."""
    rows_multiple = math.lcm(*mini_batch_sizes)
    group_multiple = rows_multiple // math.gcd(rows_multiple, group_size)
    return groups // group_multiple * group_multiple


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, [B] float32, added to the scores: 0 up to `max_response_length -
    buffer_len` tokens, then falling linearly to `-penalty_factor` at `max_response_length` (a response is never
    longer: generation stops at the budget)."""
    if not 1 <= buffer_len <= max_response_length:
        raise ValueError(f"buffer_len={buffer_len} must be in [1, max_response_length={max_response_length}]")
    expected = max_response_length - buffer_len
    excess = (response_lengths.float() - expected).clamp_min(0)
    return -excess / buffer_len * penalty_factor


def truncated_responses(responses: torch.Tensor, response_mask: torch.Tensor,
                        eos_token_ids: Sequence[int]) -> torch.Tensor:
    """[B] bool: responses cut at the budget, i.e. filling all R columns without ending in an EOS / stop token
    (the engines keep the stop token in the response). One that ends in EOS at exactly R tokens finished."""
    fills_budget = response_mask[:, -1].bool()
    stopped = torch.isin(responses[:, -1], torch.tensor(list(eos_token_ids), dtype=responses.dtype))
    return fills_budget & ~stopped


def overlong_filtered_mask(responses: torch.Tensor, response_mask: torch.Tensor,
                           eos_token_ids: Sequence[int]) -> torch.Tensor:
    """Overlong filtering: the response mask with the truncated responses' rows zeroed, for the losses."""
    finished = ~truncated_responses(responses, response_mask, eos_token_ids)
    return response_mask * finished[:, None]
