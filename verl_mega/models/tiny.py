"""Tiny random HF models of each supported family, built locally (tests, demo, benchmarks).

`AutoConfig.for_model` -> random weights -> `save_pretrained`; nothing comes from a model hub.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from verl_mega.data.tiny_tokenizer import build_tiny_tokenizer

TINY_SIZES: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256,
)
FAMILY_EXTRAS: dict[str, dict[str, Any]] = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=32),
    "mistral": dict(sliding_window=None),
    "phi3": dict(),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # Layer 1 dense; the routed experts' top-2 weights not renormalised (the checkpoints' default).
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      mlp_only_layers=[1], norm_topk_prob=False),
    # Multi-latent attention with YaRN; layer 0 dense; 8 experts in 2 groups, one group per token, 2 experts from it;
    # topk_method as the checkpoints write it (vLLM reads the expert bias only then).
    "deepseek_v3": dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc",
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # head_dim 24 ≠ 64/4; a window of 5 tokens, so that sequences of 16 reach past it.
    "gemma2": dict(head_dim=24, sliding_window=5, query_pre_attn_scalar=20, attn_logit_softcapping=4.0,
                   final_logit_softcapping=6.0),
    # head_dim 32 ≠ 64/4; layer 1 dense (intermediate_size wide); the top-2 weights renormalised, as the
    # checkpoints set it.
    "qwen3_moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                      norm_topk_prob=True),
}


def _persistent_buffers(model: torch.nn.Module) -> list[str]:
    saved = model.state_dict().keys()
    return [name for name, buffer in model.named_buffers() if name in saved and buffer.is_floating_point()]


def make_tiny_hf_model(out_dir: str | Path, model_type: str, *, vocab_size: int = 300, seed: int = 0,
                       tokenizer: bool = True, **overrides) -> Path:
    """Save a random tiny `model_type` model (and the tiny character tokenizer) into `out_dir`."""
    tok = build_tiny_tokenizer()
    special = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    kwargs = {**TINY_SIZES, **FAMILY_EXTRAS[model_type], **special, "vocab_size": max(vocab_size, len(tok)), **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random, not init-scaled, so that every mapping error shows up in the logits
        for param in model.parameters():
            param.normal_(0.0, 0.2)
        for name in _persistent_buffers(model):  # DeepSeek-V3's expert-bias correction: saved, so converted too
            model.get_buffer(name).normal_(0.0, 0.2)
    out = Path(out_dir)
    model.save_pretrained(out)
    if tokenizer:
        tok.save_pretrained(out)
    return out
