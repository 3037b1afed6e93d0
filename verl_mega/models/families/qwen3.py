"""Qwen3 (dense): per-head RMSNorm on queries and keys; head_dim may differ from hidden/heads."""
from ..spec import dense_family

SPEC = dense_family("qwen3", ("qwen3",), "Qwen3ForCausalLM", qk_norm=True)
