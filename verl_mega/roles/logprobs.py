"""Log-probs (and entropy) of given tokens under vocabulary-parallel logits, ignoring vocabulary padding."""
from __future__ import annotations

import torch

from verl_mega.ops import token_logprobs

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

    logits = mask_vocab_padding(logits.float(), vocab_size, parallel_state.get_tensor_model_parallel_rank())
    split = parallel_state.get_tensor_model_parallel_world_size() > 1
    group = parallel_state.get_tensor_model_parallel_group() if split else None
    return token_logprobs(logits, labels, tp_group=group, return_entropy=return_entropy)
