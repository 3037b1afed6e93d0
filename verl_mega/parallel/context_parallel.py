"""Context parallelism's split of each sequence over the CP ranks, as megatron-core lays it out, and its inverse.

A sequence of S positions (S a multiple of 2c, c the CP size) is cut into 2c equal chunks and CP rank r holds
chunks r and 2c-1-r, in that order (megatron.core.utils.get_batch_on_this_cp_rank). Under the causal mask an early
chunk attends to few keys and a late one to many, so one of each balances the ranks' attention work;
transformer-engine's context-parallel attention and megatron's RoPE (`get_pos_emb_on_this_cp_rank`) expect this
layout. `split_for_rank` and `restore_order` are pure tensor functions; `gather_sequence` brings the ranks' pieces
back into the whole sequence over the CP group, differentiably.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def sequence_multiple(cp: int) -> int:
    """What the sequence length must be a multiple of for the split: 2c equal chunks (1 without CP)."""
    return 2 * cp if cp > 1 else 1


def split_for_rank(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """CP rank `rank`'s part of `tensor` along the sequence dimension `dim`: chunks rank and 2cp-1-rank of 2cp."""
    if cp == 1:
        return tensor
    length = tensor.shape[dim]
    if length % sequence_multiple(cp):
        raise ValueError(f"a sequence of {length} positions does not split into {2 * cp} equal chunks for "
                         f"context parallelism over {cp} ranks: pad it to a multiple of {2 * cp}")
    chunks = tensor.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def restore_order(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of `split_for_rank`: every CP rank's piece, in rank order -> the whole sequence."""
    if len(pieces) == 1:
        return pieces[0]
    halves = [piece.chunk(2, dim) for piece in pieces]
    return torch.cat([first for first, _ in halves] + [second for _, second in reversed(halves)], dim)


def gather_sequence(local: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """This CP rank's piece of a sequence (`split_for_rank` layout along `dim`) -> the whole sequence, the same on
    every rank of the CP `group`. Backward, each rank gets the sum over the group of the gradients with respect to
    its own piece: every rank computes the same whole-sequence loss from the gathered tensor, and megatron's
    gradient all-reduce averages over the data- and context-parallel ranks together."""
    return _GatherSequence.apply(local, group, dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        local = local.contiguous()
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local, group=group)
        return restore_order(pieces, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # An all-reduce, not a reduce-scatter: gloo (CPU) has none, and the tensor is one layer's activation.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        own = split_for_rank(grad, dist.get_world_size(ctx.group), dist.get_rank(ctx.group), ctx.dim)
        return own, None, None
