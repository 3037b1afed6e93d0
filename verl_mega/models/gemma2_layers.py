"""Gemma-2 as a megatron-core layer spec: megatron's attention, MLP and parallel linears, plus the pieces
megatron's GPT layer lacks (the approach Megatron-Bridge takes):

- `ZeroCenteredRMSNorm`: RMSNorm computing x·(1+w) in fp32, as Gemma stores its norm weights around 0;
- `PostNormed(...)`: a row-parallel linear followed by a norm, for the sandwich norms on the attention and
  MLP outputs (after the TP reduction, so each rank normalises whole hidden vectors);
- `SoftCappedAttention`: megatron's dot-product attention with cap·tanh(scores/cap) before the causal or
  sliding-window mask (megatron's `window_size` / `window_attn_skip_freq` say which layers slide);
- `scale_embeddings` and `cap_final_logits`: hooks on GPTModel's embedding and output layer.

With transformer-engine (GPU) the norms fused into the column-parallel linears and the final norm are TE's,
zero-centred through `layernorm_zero_centered_gamma`, and the row-parallel linears are TE's; the attention
stays `SoftCappedAttention`, since TE's fused attention has no logit soft-capping here.
"""
from __future__ import annotations

import functools

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused_norm_options):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # Replicated over TP; with sequence parallelism its gradient is summed over the TP group.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(hidden)


@functools.cache
def PostNormed(linear_cls: type) -> type:
    """`linear_cls` (a row-parallel linear) with a `post_layernorm` on its output."""

    class PostNormedLinear(linear_cls):
        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_layernorm = ZeroCenteredRMSNorm(config, output_size, config.layernorm_epsilon)
            # A forward hook, not part of forward: LoRA adapters (`models.lora`, hooks put first) then add to the
            # linear's own output, before the norm, as the merged weight computes it.
            self.register_forward_hook(_post_normed)

    PostNormedLinear.__name__ = PostNormedLinear.__qualname__ = f"PostNormed{linear_cls.__name__}"
    return PostNormedLinear


def _post_normed(module, args, output):
    output, bias = output
    return module.post_layernorm(output), bias


class _CappedMaskedSoftmax(torch.nn.Module):
    """Stands in for megatron's FusedScaleMaskSoftmax: cap, causal (and window) mask, softmax in fp32."""

    def __init__(self, logit_softcap: float | None, window: int | None):
        super().__init__()
        self.logit_softcap, self.window = logit_softcap, window

    def forward(self, scores: torch.Tensor, mask: torch.Tensor | None, softmax_offset=None) -> torch.Tensor:
        x = scores.float()
        if self.logit_softcap:
            x = torch.tanh(x / self.logit_softcap) * self.logit_softcap
        sq, sk = x.shape[-2:]
        query_pos = torch.arange(sk - sq, sk, device=x.device)[:, None]
        key_pos = torch.arange(sk, device=x.device)[None, :]
        blocked = key_pos > query_pos
        if self.window is not None:
            blocked = blocked | (key_pos <= query_pos - self.window)
        if mask is not None:
            blocked = blocked | mask
        # The dtype's minimum rather than -inf keeps fully padded rows finite, as transformers does.
        return torch.softmax(x.masked_fill(blocked, torch.finfo(x.dtype).min), dim=-1).type_as(scores)


@functools.cache
def _soft_capped_attention(logit_softcap: float | None) -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.utils import is_layer_window_attention

    class SoftCappedAttention(DotProductAttention):
        def __init__(self, config, layer_number: int, *args, **kwargs):
            super().__init__(config, layer_number, *args, **kwargs)
            sliding = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            # megatron's window (left, 0) lets a query see `left` earlier keys besides its own position.
            self.scale_mask_softmax = _CappedMaskedSoftmax(logit_softcap, config.window_size[0] + 1 if sliding else None)

    return SoftCappedAttention


def gemma2_block_spec(config, logit_softcap: float | None, use_transformer_engine: bool):
    """This pipeline stage's Gemma-2 decoder block: its layers and the final norm."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import ModuleSpec, TransformerLayer, TransformerLayerSubmodules
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import (TELayerNormColumnParallelLinear, TENorm,
                                                                 TERowParallelLinear)

        pre_norm, column_linear, row_linear, final_norm = IdentityOp, TELayerNormColumnParallelLinear, TERowParallelLinear, TENorm
    else:
        pre_norm, column_linear, row_linear, final_norm = (ZeroCenteredRMSNorm, ColumnParallelLinear, RowParallelLinear,
                                                           ZeroCenteredRMSNorm)
    layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=pre_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=column_linear,
                    core_attention=_soft_capped_attention(logit_softcap),
                    linear_proj=PostNormed(row_linear),
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column_linear,
                                                                linear_fc2=PostNormed(row_linear))),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=final_norm)


def scale_embeddings(model, hidden_size: int) -> None:
    """Embeddings × √hidden, the factor rounded to the activations' dtype as transformers does."""

    def scale(module, inputs, output):
        return output * torch.tensor(hidden_size**0.5, dtype=output.dtype)

    model.embedding.register_forward_hook(scale)


def cap_final_logits(model, logit_softcap: float) -> None:
    """cap·tanh(logits/cap) on the output layer (elementwise, so each TP rank caps its vocabulary slice)."""

    def cap(module, inputs, output):
        logits, bias = output
        return torch.tanh(logits / logit_softcap) * logit_softcap, bias

    model.output_layer.register_forward_hook(cap)
