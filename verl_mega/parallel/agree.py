"""Decisions every rank must take together (stop, skip, refuse): one rank's flag becomes everyone's answer,
so no rank goes on into a collective that the others have left."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .state import device


def any_rank(flag: bool, group=None) -> bool:
    """Whether `flag` is set on any rank of `group` (default: the whole job); the same answer on every rank."""
    value = torch.tensor([1.0 if flag else 0.0], device=device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def all_finite(tensors) -> bool:
    """Whether every element of `tensors` is finite on every rank (a sum is NaN/inf if any element is)."""
    total = sum((t.detach().float().sum() for t in tensors if t.numel()), torch.zeros((), device=device()))
    return not any_rank(not bool(torch.isfinite(total).item()))
