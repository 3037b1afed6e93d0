"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMS norms, no q/k/v bias,
head_dim apart from hidden/heads) with routed experts only (no shared expert), a bias-free router, top-k
weights renormalised where `norm_topk_prob` says so, and dense layers where `mlp_only_layers` or
`decoder_sparse_step` say so. Checkpoints name the experts one by one (transformers 4.x and 5.x's
`save_pretrained`) or stacked per layer (transformers 5's in-memory spelling); both are read."""
from ..hf_config import HFModelConfig
from ..spec import FamilySpec, config_size, qwen3_moe_rules, qwen_expert_stacks
from .qwen2_moe import moe_layers


def transformer_overrides(hf_config: HFModelConfig) -> dict:
    return dict(
        moe_ffn_hidden_size=config_size(hf_config, "moe_intermediate_size"),
        # norm_topk_prob false: the top-k of the softmax over all experts, not renormalised.
        moe_router_pre_softmax=not hf_config.raw.get("norm_topk_prob", False),
    )


SPEC = FamilySpec(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    hf_architecture="Qwen3MoeForCausalLM",
    rules=qwen3_moe_rules(),
    qk_norm=True,
    moe=True,
    moe_layers=moe_layers,
    transformer_overrides=transformer_overrides,
    expert_stacks=qwen_expert_stacks(),
)
