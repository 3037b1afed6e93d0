"""Mistral: Llama's layout; every layer slides over `sliding_window` keys (4096 where config.json omits the key,
as transformers reads it; null in Mistral 7B v0.2 and later)."""
from ..spec import dense_family, sliding_window

SPEC = dense_family("mistral", ("mistral",), "MistralForCausalLM", window=sliding_window(default=4096))
