"""Qwen2 / Qwen2.5: always q/k/v biases; small sizes tie the embeddings (read from the config); the layers
`layer_types` names slide where `use_sliding_window` is true (false in the released checkpoints)."""
from ..spec import dense_family, sliding_window

SPEC = dense_family("qwen2", ("qwen2",), "Qwen2ForCausalLM", qkv_bias=True,
                    window=sliding_window(switch="use_sliding_window", per_layer=True))
