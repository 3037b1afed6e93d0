"""Llama 2/3/3.x (Llama-3 RoPE scaling comes from the config)."""
from ..spec import dense_family

SPEC = dense_family("llama", ("llama",), "LlamaForCausalLM")
