"""Mistral: Llama's layout."""
from ..spec import dense_family

SPEC = dense_family("mistral", ("mistral",), "MistralForCausalLM")
