"""Gemma-2 (2B, 9B, 27B): soft-capped attention and final logits, sliding-window and global layers in turn,
`query_pre_attn_scalar`, sandwich norms with x·(1+w), GeGLU (tanh GELU), embeddings × √hidden, tied
embeddings, head_dim ≠ hidden/heads. Its decoder block is `gemma2_layers.gemma2_block_spec`."""
import functools
import math

import torch.nn.functional as F

from ..gemma2_layers import cap_final_logits, gemma2_block_spec, scale_embeddings
from ..hf_config import HFModelConfig
from ..spec import FamilySpec, config_size, gemma2_rules


def sliding_layers(hf_config: HFModelConfig) -> list[bool]:
    """transformers' `layer_types`, or its default for older configs: even layers slide."""
    layer_types = hf_config.raw.get("layer_types") or ["sliding_attention" if layer % 2 == 0 else "full_attention"
                                                 for layer in range(hf_config.num_layers)]
    return [kind == "sliding_attention" for kind in layer_types]


def check_config(hf_config: HFModelConfig) -> None:
    """Gemma-2's keys the mapping reads beyond the common ones, refused up front where it cannot run them."""
    if hf_config.raw.get("use_bidirectional_attention"):
        raise ValueError("config.json: gemma2 'use_bidirectional_attention' must be false: the decoder here is causal")
    if any(sliding_layers(hf_config)):
        config_size(hf_config, "sliding_window")
    for key, nullable in (("query_pre_attn_scalar", False), ("attn_logit_softcapping", True),
                          ("final_logit_softcapping", True)):
        value = hf_config.raw.get(key)
        if not (nullable and value is None) and (type(value) not in (int, float) or not 0 < value < math.inf):
            raise ValueError(f"config.json: gemma2 '{key}' must be a positive number{' or null' * nullable}, "
                             f"got {value!r}")


def transformer_overrides(hf_config: HFModelConfig) -> dict:
    raw = hf_config.raw
    sliding = sliding_layers(hf_config)
    return dict(
        activation_func=functools.partial(F.gelu, approximate="tanh"),
        softmax_scale=raw.get("query_pre_attn_scalar", hf_config.head_dim) ** -0.5,
        # megatron's window counts the earlier keys a query sees; transformers' includes the query itself.
        window_size=(raw["sliding_window"] - 1, 0) if any(sliding) else None,
        window_attn_skip_freq=[int(s) for s in sliding],
        layernorm_zero_centered_gamma=True,
    )


def block_spec(hf_config: HFModelConfig, config, use_transformer_engine: bool):
    return gemma2_block_spec(config, hf_config.raw.get("attn_logit_softcapping"), use_transformer_engine)


def finish_model(model, hf_config: HFModelConfig) -> None:
    if model.pre_process:
        scale_embeddings(model, hf_config.hidden_size)
    if model.post_process and hf_config.raw.get("final_logit_softcapping"):
        cap_final_logits(model, hf_config.raw["final_logit_softcapping"])


SPEC = FamilySpec(
    name="gemma2",
    model_types=("gemma2",),
    hf_architecture="Gemma2ForCausalLM",
    rules=gemma2_rules(),
    transformer_overrides=transformer_overrides,
    block_spec=block_spec,
    finish_model=finish_model,
    check_config=check_config,
    activations=("gelu_pytorch_tanh", "gelu_tanh"),  # the tanh GELU that `transformer_overrides` runs
    local_attention=True,  # the soft-capped attention of `block_spec`
)
