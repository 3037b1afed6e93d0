"""Phi-3: HF stores q/k/v fused as `qkv_proj` ([q; k; v]) and gate/up as `gate_up_proj` ([gate; up]); every layer
slides over `sliding_window` keys where it is set (2047 in Phi-3-mini-4k)."""
from ..spec import dense_family, sliding_window

SPEC = dense_family("phi3", ("phi3",), "Phi3ForCausalLM", fused=True, window=sliding_window())
