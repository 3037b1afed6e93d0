"""DeepSeek-V3 (also DeepSeek-R1, Kimi-K2, Moonlight): multi-latent attention and MoE layers with shared experts.

Attention: queries through a low-rank projection with its norm (`q_lora_rank`; plain `q_proj` without it), keys
and values through one compressed latent with its norm plus a decoupled RoPE part shared by every head; YaRN
RoPE with its mscale. MoE: sigmoid scores with the expert-bias correction (`e_score_correction_bias`, a buffer
megatron updates outside the gradient), group-limited top-k, `routed_scaling_factor`; the first
`first_k_dense_replace` layers are dense.

RoPE layout: DeepSeek stores each head's rope dims in interleaved pairs (transformers' `rope_interleave`), and
megatron's MLA de-interleaves them before rotating, so the weights map as they are; a checkpoint in the other
layout is refused (its permutation would not commute with megatron's contiguous TP split of the kv
down-projection, whose last rows hold the rope part).
"""
import math

from ..hf_config import HFModelConfig
from ..mla_layers import mla_block_spec
from ..spec import (_H, _L, FamilySpec, TensorRule, GATE_UP, _dense_mlp_rules, _embedding_rules, config_size,
                    qwen_expert_stacks)


def _sizes(hf_config: HFModelConfig) -> dict[str, int]:
    return {key: config_size(hf_config, key) for key in
            ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size",
             "n_shared_experts")}


def _q_lora_rank(hf_config: HFModelConfig) -> int | None:
    return None if hf_config.raw.get("q_lora_rank") is None else config_size(hf_config, "q_lora_rank")


def _q_rows(hf_config: HFModelConfig) -> int:
    sizes = _sizes(hf_config)
    return hf_config.num_heads * (sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"])


def _attention_rules() -> tuple[TensorRule, ...]:
    attn, mla = _H + "self_attn.", _L + "self_attention."
    return (
        TensorRule(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), shape=lambda c: (c.hidden_size,)),
        TensorRule(mla + "linear_q_proj.weight", (attn + "q_proj.weight",), tp_dim=0, when="q_full",
                   shape=lambda c: (_q_rows(c), c.hidden_size)),
        # megatron's local spec makes both down-projections column-parallel (gathered after): rows split over TP.
        TensorRule(mla + "linear_q_down_proj.weight", (attn + "q_a_proj.weight",), tp_dim=0, when="q_lora",
                   shape=lambda c: (_q_lora_rank(c), c.hidden_size)),
        TensorRule(mla + "linear_q_up_proj.layer_norm_weight", (attn + "q_a_layernorm.weight",), when="q_lora",
                   shape=lambda c: (_q_lora_rank(c),)),
        TensorRule(mla + "linear_q_up_proj.weight", (attn + "q_b_proj.weight",), tp_dim=0, when="q_lora",
                   shape=lambda c: (_q_rows(c), _q_lora_rank(c))),
        TensorRule(mla + "linear_kv_down_proj.weight", (attn + "kv_a_proj_with_mqa.weight",), tp_dim=0,
                   shape=lambda c: (_sizes(c)["kv_lora_rank"] + _sizes(c)["qk_rope_head_dim"], c.hidden_size)),
        TensorRule(mla + "linear_kv_up_proj.layer_norm_weight", (attn + "kv_a_layernorm.weight",),
                   shape=lambda c: (_sizes(c)["kv_lora_rank"],)),
        TensorRule(mla + "linear_kv_up_proj.weight", (attn + "kv_b_proj.weight",), tp_dim=0,
                   shape=lambda c: (c.num_heads * (_sizes(c)["qk_nope_head_dim"] + _sizes(c)["v_head_dim"]),
                                    _sizes(c)["kv_lora_rank"])),
        TensorRule(mla + "linear_proj.weight", (attn + "o_proj.weight",), tp_dim=1,
                   shape=lambda c: (c.hidden_size, c.num_heads * _sizes(c)["v_head_dim"])),
    )


def _moe_rules() -> tuple[TensorRule, ...]:
    mlp, shared = _H + "mlp.", _L + "mlp.shared_experts."
    expert, hf_expert = _L + "mlp.experts.local_experts.{expert}.", mlp + "experts.{expert}."

    def ffn(c):
        return _sizes(c)["moe_intermediate_size"]

    def shared_ffn(c):
        return _sizes(c)["moe_intermediate_size"] * _sizes(c)["n_shared_experts"]

    return (
        TensorRule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), when="moe_layer"),
        TensorRule(_L + "mlp.router.weight", (mlp + "gate.weight",), when="moe_layer"),
        TensorRule(_L + "mlp.router.expert_bias", (mlp + "gate.e_score_correction_bias",), when="moe_layer",
                   shape=lambda c: (c.num_experts,), fp32=True),
        TensorRule(expert + "linear_fc1.weight", (hf_expert + "gate_proj.weight", hf_expert + "up_proj.weight"), GATE_UP,
                   tp_dim=0, when="moe_layer", shape=lambda c: (2 * ffn(c), c.hidden_size)),
        TensorRule(expert + "linear_fc2.weight", (hf_expert + "down_proj.weight",), tp_dim=1, when="moe_layer",
                   shape=lambda c: (c.hidden_size, ffn(c))),
        TensorRule(shared + "linear_fc1.weight", (mlp + "shared_experts.gate_proj.weight",
                                                 mlp + "shared_experts.up_proj.weight"),
                   GATE_UP, tp_dim=0, when="moe_layer", shape=lambda c: (2 * shared_ffn(c), c.hidden_size)),
        TensorRule(shared + "linear_fc2.weight", (mlp + "shared_experts.down_proj.weight",), tp_dim=1, when="moe_layer",
                   shape=lambda c: (c.hidden_size, shared_ffn(c))),
    )


def moe_layers(hf_config: HFModelConfig) -> list[bool]:
    first_moe = hf_config.raw.get("first_k_dense_replace", 0)
    return [layer >= first_moe for layer in range(hf_config.num_layers)]


def conditions(hf_config: HFModelConfig) -> dict[str, bool]:
    q_lora = _q_lora_rank(hf_config) is not None
    return {"q_lora": q_lora, "q_full": not q_lora}


def _rope(hf_config: HFModelConfig) -> dict:
    scaling = hf_config.rope_scaling
    rope = dict(qk_pos_emb_head_dim=_sizes(hf_config)["qk_rope_head_dim"], rotary_base=hf_config.rope_theta)
    if scaling["rope_type"] != "yarn":
        return dict(rope, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return dict(rope, rope_type="yarn", rotary_scaling_factor=float(scaling["factor"]),
                original_max_position_embeddings=scaling["original_max_position_embeddings"],
                beta_fast=float(scaling.get("beta_fast", 32)), beta_slow=float(scaling.get("beta_slow", 1)),
                mscale=float(scaling.get("mscale", 1.0)), mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)))


def transformer_overrides(hf_config: HFModelConfig) -> dict:
    raw, sizes = hf_config.raw, _sizes(hf_config)
    n_group = raw.get("n_group") or 1
    return dict(
        _rope(hf_config),
        q_lora_rank=_q_lora_rank(hf_config),
        kv_lora_rank=sizes["kv_lora_rank"],
        qk_head_dim=sizes["qk_nope_head_dim"],
        v_head_dim=sizes["v_head_dim"],
        moe_ffn_hidden_size=sizes["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=sizes["moe_intermediate_size"] * sizes["n_shared_experts"],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=n_group if n_group > 1 else None,
        moe_router_group_topk=raw.get("topk_group") if n_group > 1 else None,
        moe_router_topk_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        # transformers routes in fp32 whatever the model's dtype (the router weight and bias stay fp32).
        moe_router_dtype="fp32",
    )


# Layers are looked up one by one (their expert stacks): as many as a config may have layers at all.
_LARGEST_PREDICTION_LAYERS = 2 ** 16


def _refuse(key: str, why: str) -> None:
    raise ValueError(f"config.json: deepseek_v3 '{key}' {why}")


def check_config(hf_config: HFModelConfig) -> None:
    """What megatron's MLA and router cannot reproduce of transformers' DeepseekV3, refused up front."""
    raw, sizes = hf_config.raw, _sizes(hf_config)
    _q_lora_rank(hf_config)  # a positive integer or null
    if raw.get("rope_interleave", True) is not True:
        _refuse("rope_interleave", "must be true: megatron's MLA reads the rope dims in DeepSeek's interleaved layout")
    if hf_config.num_kv_heads != hf_config.num_heads:
        _refuse("num_key_value_heads", f"={hf_config.num_kv_heads} must equal num_attention_heads={hf_config.num_heads} "
                "(multi-latent attention expands keys and values for every head)")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        _refuse("scoring_func", f"is {raw['scoring_func']!r}; only 'sigmoid' (DeepSeek-V3's) is supported")
    top_k = hf_config.moe_top_k
    if type(top_k) is not int or top_k < 2 or raw.get("norm_topk_prob") is not True:
        _refuse("norm_topk_prob", "must be true with num_experts_per_tok >= 2: megatron's sigmoid router always "
                "renormalises the top-k weights")
    n_group, topk_group = raw.get("n_group") or 1, raw.get("topk_group") or 1
    if type(n_group) is not int or type(topk_group) is not int or hf_config.num_experts % n_group \
            or not 1 <= topk_group <= n_group:
        _refuse("n_group", f"={n_group!r} must divide n_routed_experts={hf_config.num_experts} and be at least "
                f"topk_group={topk_group!r} (a positive integer)")
    if topk_group < n_group and top_k // topk_group != 2:
        _refuse("topk_group", f"={topk_group}: megatron ranks groups by their top num_experts_per_tok // topk_group "
                "scores, transformers by their top 2, so num_experts_per_tok must be 2 x topk_group")
    first_dense, scale = raw.get("first_k_dense_replace", 0), raw.get("routed_scaling_factor", 1.0)
    if type(first_dense) is not int or not 0 <= first_dense <= hf_config.num_layers:
        _refuse("first_k_dense_replace", f"={first_dense!r} must be an integer in [0, num_hidden_layers="
                f"{hf_config.num_layers}]")
    if type(scale) not in (int, float) or not 0 < scale < math.inf:
        _refuse("routed_scaling_factor", f"={scale!r} must be a positive number")
    if hf_config.rope_scaling["rope_type"] not in ("default", "yarn"):
        _refuse("rope_scaling", f"type {hf_config.rope_scaling['rope_type']!r}: only default and yarn are supported")
    if sizes["qk_rope_head_dim"] % 2:
        _refuse("qk_rope_head_dim", "must be even")
    prediction_layers(hf_config)


def prediction_layers(hf_config: HFModelConfig) -> int:
    """The multi-token-prediction layers checkpoints carry after the last (`num_nextn_predict_layers`, null: none):
    transformers and the megatron model here do not run them, speculative decoding does."""
    count = hf_config.raw.get("num_nextn_predict_layers")
    if count is not None and (type(count) is not int or not 0 <= count <= _LARGEST_PREDICTION_LAYERS):
        _refuse("num_nextn_predict_layers", f"={count!r} must be an integer in [0, {_LARGEST_PREDICTION_LAYERS}] or null")
    return count or 0


def block_spec(hf_config: HFModelConfig, config, use_transformer_engine: bool):
    return mla_block_spec(config, use_transformer_engine)


SPEC = FamilySpec(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    hf_architecture="DeepseekV3ForCausalLM",
    rules=_embedding_rules() + _attention_rules() + _moe_rules() + _dense_mlp_rules(when="dense_layer"),
    qk_norm=True,  # builds MLA's q and kv latent norms
    moe=True,
    moe_layers=moe_layers,
    transformer_overrides=transformer_overrides,
    block_spec=block_spec,
    mla=True,
    conditions=conditions,
    check_config=check_config,
    expert_stacks=qwen_expert_stacks(),  # transformers 5 stacks the routed experts as it does Qwen2-MoE's
    unread_layers=prediction_layers,
)
