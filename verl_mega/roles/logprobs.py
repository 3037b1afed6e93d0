"""Log-probs (and entropy) of given tokens under vocabulary-parallel logits, ignoring vocabulary padding; the
collision probability sum_v p_v^2 of each position's distribution (the optimal token baseline's input)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from verl_mega.ops import token_logprobs

PADDING_LOGIT = -1e30


def padding_logit(dtype: torch.dtype) -> float:
    """PADDING_LOGIT, or fp16's most negative finite value where -1e30 would overflow to -inf."""
    return max(PADDING_LOGIT, torch.finfo(dtype).min)


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Padded vocabulary rows of the output layer give logit 0, which would take probability mass: remove it.

    A large finite value, not -inf nor fp32's minimum: a TP slice made only of padding then still gives
    finite partial sums (count * value, summed in fp32 by the kernel), which the cross-rank combination
    scales by exp(-huge) = 0.
    """
    local_vocab = logits.shape[-1]
    first = tp_rank * local_vocab
    if first + local_vocab <= vocab_size:
        return logits
    padding = torch.arange(first, first + local_vocab, device=logits.device) >= vocab_size
    return logits.masked_fill(padding, padding_logit(logits.dtype))


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int, return_entropy: bool):
    """logits [..., V/tp] (this TP rank's slice), labels [...] -> float32 log p(labels) [, entropy].

    The logits stay in the model's dtype: the kernels accumulate in fp32 and return the gradient in the logits'
    dtype, where an fp32 copy would be the step's largest tensor (4 bytes per token and vocabulary entry, kept
    for backward, and its fp32 gradient as many again)."""
    from megatron.core import parallel_state

    logits = mask_vocab_padding(logits, vocab_size, parallel_state.get_tensor_model_parallel_rank())
    split = parallel_state.get_tensor_model_parallel_world_size() > 1
    group = parallel_state.get_tensor_model_parallel_group() if split else None
    return token_logprobs(logits, labels, tp_group=group, return_entropy=return_entropy)


def vocab_parallel_sum_pi_squared(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """logits [..., V/tp] (this TP rank's slice) -> float32 sum_v softmax(logits)_v^2 over the whole vocabulary,
    as exp(logsumexp(2 x) - 2 logsumexp(x)). Forward-only (no gradient is needed): it holds an fp32 copy of
    the slice while it runs."""
    from megatron.core import parallel_state

    logits = mask_vocab_padding(logits, vocab_size, parallel_state.get_tensor_model_parallel_rank()).float()
    split = parallel_state.get_tensor_model_parallel_world_size() > 1
    group = parallel_state.get_tensor_model_parallel_group() if split else None
    return (_logsumexp(2 * logits, group) - 2 * _logsumexp(logits, group)).exp()


def _logsumexp(values: torch.Tensor, group) -> torch.Tensor:
    """logsumexp over the last dimension, the slices of `group`'s ranks together (None: this slice alone)."""
    top = values.amax(dim=-1)
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sums = (values - top.unsqueeze(-1)).exp().sum(dim=-1)
    if group is not None:
        dist.all_reduce(sums, group=group)
    return top + sums.log()


def vocab_parallel_topk(logits: torch.Tensor, k: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V/tp] (this TP rank's slice) -> the k most likely tokens of the whole vocabulary: their
    float32 log-probs [..., k] (normalised over the whole vocabulary) and ids [..., k], the same on every TP rank.
    Forward-only: it holds an fp32 copy of the slice while it runs."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    logits = mask_vocab_padding(logits, vocab_size, tp_rank).float()
    split = parallel_state.get_tensor_model_parallel_world_size() > 1
    group = parallel_state.get_tensor_model_parallel_group() if split else None
    local_vocab = logits.shape[-1]
    values, ids = logits.topk(min(k, local_vocab), dim=-1)
    ids = ids + tp_rank * local_vocab
    if group is not None:  # each slice's best k, then the best k of those
        values, ids = _all_gather_last(values, group), _all_gather_last(ids, group)
        values, chosen = values.topk(k, dim=-1)
        ids = ids.gather(-1, chosen)
    return values - _logsumexp(logits, group).unsqueeze(-1), ids


def _all_gather_last(tensor: torch.Tensor, group) -> torch.Tensor:
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def vocab_parallel_gather_logprobs(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """logits [..., V/tp] (this TP rank's slice), ids [..., k] of the whole vocabulary -> float32 log-probs
    [..., k] of those tokens, differentiable with respect to the logits (the sums over the TP ranks are megatron's
    autograd-aware all-reduce: the gradient of each rank's share is the same upstream gradient)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    logits = mask_vocab_padding(logits, vocab_size, tp_rank).float()
    split = parallel_state.get_tensor_model_parallel_world_size() > 1
    local_vocab = logits.shape[-1]
    local_ids = ids.long() - tp_rank * local_vocab
    here = (local_ids >= 0) & (local_ids < local_vocab)
    picked = logits.gather(-1, local_ids.clamp(0, local_vocab - 1)) * here
    top = logits.detach().amax(dim=-1, keepdim=True)
    if split:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    sums = (logits - top).exp().sum(dim=-1, keepdim=True)
    if split:
        picked, sums = reduce_from_tensor_model_parallel_region(picked), reduce_from_tensor_model_parallel_region(sums)
    return picked - top - sums.log()
