"""Log-probs (and entropy) of given tokens under vocabulary-parallel logits, ignoring vocabulary padding.

`verl_mega.ops.token_logprobs` does the work when it is installed. Until it lands, megatron's
`vocab_parallel_cross_entropy` gives the log-probs and a short differentiable formula the entropy.
TODO(ops): drop `_megatron_token_logprobs` once `verl_mega.ops` is merged.
"""
from __future__ import annotations

import torch

try:
    from verl_mega.ops import token_logprobs
except ImportError:
    token_logprobs = None


PADDING_LOGIT = -1e30


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Padded vocabulary rows of the output layer give logit 0, which would take probability mass: remove it.

    A large finite value, not -inf nor the dtype's minimum: a TP slice made only of padding then still
    gives finite partial sums (count * value), which the cross-rank combination scales by exp(-huge) = 0.
    """
    local_vocab = logits.shape[-1]
    first = tp_rank * local_vocab
    if first + local_vocab <= vocab_size:
        return logits
    padding = torch.arange(first, first + local_vocab, device=logits.device) >= vocab_size
    return logits.masked_fill(padding, PADDING_LOGIT)


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int, return_entropy: bool):
    """logits [..., V/tp] (this TP rank's slice), labels [...] -> float32 log p(labels) [, entropy]."""
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    logits = mask_vocab_padding(logits.float(), vocab_size, parallel_state.get_tensor_model_parallel_rank())
    if token_logprobs is not None:
        group = tp_group if parallel_state.get_tensor_model_parallel_world_size() > 1 else None
        return token_logprobs(logits, labels, tp_group=group, return_entropy=return_entropy)
    return _megatron_token_logprobs(logits, labels, tp_group, return_entropy)


def _megatron_token_logprobs(logits, labels, tp_group, return_entropy):
    from megatron.core import tensor_parallel

    # vocab_parallel_cross_entropy expects [s, b, v] and rewrites its input in place.
    log_probs = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels)
    if not return_entropy:
        return log_probs
    return log_probs, _vocab_parallel_entropy(logits, tp_group)


def _vocab_parallel_entropy(logits, tp_group):
    """H = log Z - sum(p * z), with the max, Z and sum(p * z) reduced over the TP slices."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    shift = logits.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - shift
    exp = shifted.exp()
    # Every TP rank computes the same loss from these sums, so their backward is the identity (megatron's
    # reduce region), not the all-reduce that torch.distributed.nn would sum tp copies of the gradient with.
    partition = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    return partition.log() - weighted / partition
