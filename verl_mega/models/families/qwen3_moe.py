"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMS norms, no q/k/v bias,
head_dim apart from hidden/heads) with routed experts only (no shared expert), a bias-free router, top-k
weights renormalised where `norm_topk_prob` says so, and dense layers where `mlp_only_layers` or
`decoder_sparse_step` say so. Checkpoints name the experts one by one (transformers 4.x and 5.x's
`save_pretrained`) or stacked per layer (transformers 5's in-memory spelling); both are read."""
from ..spec import FamilySpec, qwen3_moe_rules, qwen_expert_stacks, sliding_window
from .qwen2_moe import check_config, moe_layers, routed_expert_overrides


SPEC = FamilySpec(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    hf_architecture="Qwen3MoeForCausalLM",
    rules=qwen3_moe_rules(),
    qk_norm=True,
    moe=True,
    moe_layers=moe_layers,
    transformer_overrides=routed_expert_overrides,  # no shared expert
    check_config=check_config,
    expert_stacks=qwen_expert_stacks(),
    unmodelled_window=sliding_window(switch="use_sliding_window"),  # on every layer
)
