"""Attention for one new token per row on the CPU: two matmuls, where SDPA's CPU kernel spends its time in set-up.

A decode step asks each row's single query to attend over its KV cache. torch's CPU SDPA kernel (flash
attention, blocked for long queries) took 100 us per call at the tiny test model's decode shapes on 2 threads
(32 rows, 4 query heads over 2 KV heads, 40 cached tokens, head dim 16) against 25 us for the same arithmetic
as two matmuls and a softmax; from 64 to 2048 cached tokens at head dims 16 to 128 it took 1.0-3.3x the
matmuls' time on 2 threads, 0.9-1.1x on 1. A whole rollout of that tiny model (8 prompts of 18-30 tokens x 4
samples, 16 new tokens) went from 31.9 to 26.3 ms, ~4 % of it with the trainer's 10-15-token copy prompts
(SDPA's cost grows with the cache); a 110M model's was unchanged within the machine's noise. The query heads
sharing a KV head are stacked as the rows of one matmul, so grouped-query attention copies no keys or values
(transformers' eager path repeats them).

Everything else (prefill, GPUs, low-precision dtypes, soft-capping, position biases, dropout) goes to
transformers' SDPA path unchanged: in bf16 or fp16 the matmul path would round the scores to the input dtype
before the softmax, which SDPA does not.
"""
from __future__ import annotations

import torch

IMPLEMENTATION = "verl_mega_decode"
_EXACT_DTYPES = (torch.float32, torch.float64)


def single_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None,
                           scale: float) -> torch.Tensor:
    """softmax(scale * q k^T, masked) v for query [b, heads, 1, d] over key, value [b, kv_heads, L, d]; `keep`
    (bool, broadcastable to [b, 1, 1, L]) marks the positions attended to, None for all. Returns [b, 1, heads, d]."""
    rows, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(scale)
    if keep is not None:
        scores.masked_fill_(keep.logical_not(), float("-inf"))
    # [b, kv_heads, group, d] is [b, heads, d] in memory, head h reading KV head h // group as repeat_kv orders them
    return torch.matmul(scores.softmax(-1), value).reshape(rows, 1, heads, value.shape[-1])


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; masks come from its SDPA mask builder (bool, True = attend)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (query.shape[2] == 1 and query.device.type == "cpu" and query.dtype in _EXACT_DTYPES and not dropout
             and (attention_mask is None or attention_mask.dtype == torch.bool)
             and key.shape[-1] == value.shape[-1] and query.shape[1] % key.shape[1] == 0
             and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
             and not kwargs.get("output_attentions"))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return single_query_attention(query, key, value, attention_mask, scale), None


def use_decode_attention(model: torch.nn.Module) -> None:
    """Switch a transformers model that attends with SDPA to this implementation (registered once, by name);
    models on any other implementation (eager for soft-capping families, flash kernels) keep theirs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(IMPLEMENTATION)
