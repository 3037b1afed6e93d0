"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): routed experts beside a shared expert with a sigmoid gate;
dense layers where `mlp_only_layers` or `decoder_sparse_step` say so; always q/k/v biases."""
from ..hf_config import HFModelConfig
from ..spec import (FamilySpec, config_size, qwen2_moe_rules, qwen_expert_stacks, refuse_renormalised_top1,
                    sliding_window)


def moe_layers(hf_config: HFModelConfig) -> list[bool]:
    dense = hf_config.raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(type(layer) is not int for layer in dense):
        raise ValueError(f"config.json: 'mlp_only_layers' must be a list of layer numbers, got {dense!r}")
    step = config_size(hf_config, "decoder_sparse_step") if "decoder_sparse_step" in hf_config.raw else 1
    return [layer not in dense and (layer + 1) % step == 0 for layer in range(hf_config.num_layers)]


def routed_expert_overrides(hf_config: HFModelConfig) -> dict:
    """The routed experts' settings Qwen2-MoE and Qwen3-MoE share."""
    return dict(
        moe_ffn_hidden_size=config_size(hf_config, "moe_intermediate_size"),
        # norm_topk_prob false: the top-k of the softmax over all experts, not renormalised.
        moe_router_pre_softmax=not hf_config.raw.get("norm_topk_prob", False),
    )


def check_config(hf_config: HFModelConfig) -> None:
    """Qwen2-MoE's and Qwen3-MoE's: top-1 routing runs where transformers does not renormalise it."""
    if hf_config.raw.get("norm_topk_prob", False):
        refuse_renormalised_top1(hf_config)


def transformer_overrides(hf_config: HFModelConfig) -> dict:
    return dict(
        routed_expert_overrides(hf_config),
        moe_shared_expert_intermediate_size=hf_config.raw["shared_expert_intermediate_size"],
        moe_shared_expert_gate=True,
    )


SPEC = FamilySpec(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    hf_architecture="Qwen2MoeForCausalLM",
    rules=qwen2_moe_rules(),
    qkv_bias=True,
    moe=True,
    moe_layers=moe_layers,
    transformer_overrides=transformer_overrides,
    check_config=check_config,
    expert_stacks=qwen_expert_stacks(),
    unmodelled_window=sliding_window(switch="use_sliding_window", per_layer=True),
)
