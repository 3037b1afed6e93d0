"""Qwen3 (dense): per-head RMSNorm on queries and keys; head_dim may differ from hidden/heads; the layers
`layer_types` names slide where `use_sliding_window` is true (false in the released checkpoints)."""
from ..spec import dense_family, sliding_window

SPEC = dense_family("qwen3", ("qwen3",), "Qwen3ForCausalLM", qk_norm=True,
                    window=sliding_window(switch="use_sliding_window", per_layer=True))
