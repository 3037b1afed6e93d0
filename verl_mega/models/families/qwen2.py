"""Qwen2 / Qwen2.5: always q/k/v biases; small sizes tie the embeddings (read from the config)."""
from ..spec import dense_family

SPEC = dense_family("qwen2", ("qwen2",), "Qwen2ForCausalLM", qkv_bias=True)
