"""The shape of every tensor a config implies, on both sides: megatron (TP-merged or one TP shard) and HF.

The converters check the files they read against these before writing anything (a config.json that
disagrees with its tensors must not produce a checkpoint), and `plan` sizes a model from config.json alone.
"""
from __future__ import annotations

from typing import Sequence

from .hf_config import HFModelConfig
from .sharding import TensorSlot, rank_slots
from .spec import EXPERT, LAYER, LM_HEAD, FamilySpec, TensorRule

_PER_LAYER_PREFIX = f"decoder.layers.{LAYER}."
_EXPERT_PREFIX = f"mlp.experts.local_experts.{EXPERT}."


def mcore_shape(rule: TensorRule, hf_config: HFModelConfig) -> tuple[int, ...]:
    """The whole (TP-merged) megatron tensor, vocabulary unpadded: the rule's own `shape` when it declares one
    (a family's tensors beyond the shared names below), else the shape of its shared megatron name."""
    if rule.shape is not None:
        return tuple(rule.shape(hf_config))
    hidden, head_dim, ffn = hf_config.hidden_size, hf_config.head_dim, hf_config.ffn_hidden_size
    qkv_rows = (hf_config.num_heads + 2 * hf_config.num_kv_heads) * head_dim
    if rule.mcore.startswith("output_layer.") and not rule.vocab:  # a head with one output (the critic's value)
        return (1, hidden) if rule.mcore == LM_HEAD else (1,)
    shapes = {
        "embedding.word_embeddings.weight": (hf_config.vocab_size, hidden),
        LM_HEAD: (hf_config.vocab_size, hidden),
        "decoder.final_layernorm.weight": (hidden,),
        "self_attention.linear_qkv.layer_norm_weight": (hidden,),
        "self_attention.linear_qkv.weight": (qkv_rows, hidden),
        "self_attention.linear_qkv.bias": (qkv_rows,),
        "self_attention.q_layernorm.weight": (head_dim,),
        "self_attention.k_layernorm.weight": (head_dim,),
        "self_attention.linear_proj.weight": (hidden, hf_config.num_heads * head_dim),
        "mlp.linear_fc1.layer_norm_weight": (hidden,),
        "pre_mlp_layernorm.weight": (hidden,),
        "mlp.linear_fc1.weight": (2 * ffn, hidden),
        "mlp.linear_fc2.weight": (hidden, ffn),
        "mlp.router.weight": (hf_config.num_experts or 0, hidden),
        "linear_fc1.weight": (2 * ffn, hidden),
        "linear_fc2.weight": (hidden, ffn),
    }
    name = rule.mcore.removeprefix(_PER_LAYER_PREFIX).removeprefix(_EXPERT_PREFIX)
    if name not in shapes:
        raise ValueError(f"the family spec's tensor '{rule.mcore}' has no known shape: give its TensorRule a "
                         "`shape` (config -> shape)")
    return shapes[name]


def mcore_shard_shape(slot: TensorSlot, hf_config: HFModelConfig, tp: int, padded_vocab: int) -> tuple[int, ...]:
    """One TP rank's shard of the slot's megatron tensor, as stored in a Megatron-LM shard file."""
    shape = list(mcore_shape(slot.rule, hf_config))
    if slot.rule.vocab:
        shape[0] = padded_vocab
    if slot.rule.tp_dim is not None:
        shape[slot.rule.tp_dim] //= tp
    return tuple(shape)


def hf_shapes(rule: TensorRule, hf_config: HFModelConfig) -> list[tuple[int, ...]]:
    """The HF source tensors of a rule, in `rule.hf` order (a fused source holds the whole megatron tensor)."""
    whole = mcore_shape(rule, hf_config)
    if rule.fusion is not None or len(rule.hf) == 1:
        return [whole]
    return [(rows, *whole[1:]) for rows in rule.row_merge.source_rows(whole[0], hf_config)]


def expected_hf_shapes(hf_config: HFModelConfig, family: FamilySpec,
                       head_rules: Sequence[TensorRule] | None = None) -> dict[str, tuple[int, ...]]:
    """HF name -> shape for every tensor an HF checkpoint of this config holds (`head_rules`: see `rank_slots`)."""
    return {name: shape for slot in rank_slots(hf_config, family, head_rules=head_rules)
            for name, shape in zip(slot.hf_names, hf_shapes(slot.rule, hf_config))}
