"""Multi-latent attention's decoder block (DeepSeek-V3), runnable with megatron-core's own modules.

megatron-core 0.16's local layer spec pairs `MLASelfAttention` with `DotProductAttention`, which takes neither
the `k_channels` nor the `v_channels` MLA builds it with (keys of nope + rope dims, values of `v_head_dim`): only
transformer-engine's attention runs MLA there. `LatentDotProductAttention` is the local attention with values
narrower than keys.
"""
from __future__ import annotations

import dataclasses
import functools


@functools.cache
def latent_dot_product_attention() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class LatentDotProductAttention(DotProductAttention):
        """megatron's local attention; its output holds `v_channels` per head (the softmax scale comes from MLA).
        megatron's `Attention` first builds it without the channels, then MLA builds it again with them."""

        def __init__(self, config, layer_number: int, *args, k_channels: int | None = None,
                     v_channels: int | None = None, **kwargs):
            super().__init__(config, layer_number, *args, **kwargs)
            if v_channels is not None:
                heads_here = divide(config.num_attention_heads, self.tp_group.size())
                self.hidden_size_per_partition = v_channels * heads_here

    return LatentDotProductAttention


def mla_block_spec(config, use_transformer_engine: bool):
    """This pipeline stage's decoder block: megatron's MLA layers (dense and MoE as `config.moe_layer_freq` says).

    Locally the core attention is `LatentDotProductAttention`. With transformer-engine the q and kv
    down-projections become column-parallel, as in the local spec, so that a checkpoint splits them the same way
    for either (transformer-engine's spec replicates them)."""
    from megatron.core.models.gpt import gpt_layer_specs

    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine,
                                                       normalization="RMSNorm")
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

        swap = dict(linear_q_down_proj=TEColumnParallelLinear, linear_kv_down_proj=TEColumnParallelLinear)
    else:
        swap = dict(core_attention=latent_dot_product_attention())
    for layer in block.layer_specs:
        attention = layer.submodules.self_attention
        attention.submodules = dataclasses.replace(attention.submodules, **swap)
    return block
