"""Mixtral: sparse MoE; router `gate`, experts w1 (gate), w3 (up), w2 (down)."""
from ..spec import moe_family

SPEC = moe_family("mixtral", ("mixtral",), "MixtralForCausalLM")
