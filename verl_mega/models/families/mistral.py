"""Mistral: Llama's layout; every layer slides over `sliding_window` keys (4096 where config.json omits the key,
as transformers reads it; null from Mistral 7B v0.2 on)."""
from ..spec import dense_family, sliding_window

SPEC = dense_family("mistral", ("mistral",), "MistralForCausalLM", window=sliding_window())
