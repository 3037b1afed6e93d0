"""Phi-3: HF stores q/k/v fused as `qkv_proj` ([q; k; v]) and gate/up as `gate_up_proj` ([gate; up])."""
from ..spec import dense_family

SPEC = dense_family("phi3", ("phi3",), "Phi3ForCausalLM", fused=True)
