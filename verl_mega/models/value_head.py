"""The critic's value head, everything about it in one place: the module that takes the LM head's place in
megatron's GPTModel, and what its tensors are called on either side of a conversion.

On the megatron side it is the model's `output_layer` (`output_layer.weight` [1, h] and `output_layer.bias`
[1]), the names megatron's sharded state dict looks up for the output layer, so step checkpoints need no
special case. On the HF side it is transformers' `*ForTokenClassification` head with num_labels=1 (`score`,
with bias) in every supported family; nothing of it is tied to the embedding.
"""
from __future__ import annotations

import torch

from .chunks import model_chunks
from .spec import TensorRule

VALUE_HEAD_RULES = (
    TensorRule("output_layer.weight", ("score.weight",)),
    TensorRule("output_layer.bias", ("score.bias",)),
)


class ValueHead(torch.nn.Module):
    """Takes the LM head's place in GPTModel: [s, b, h] -> ([s, b, 1], None), as the output layer returns.

    Replicated, not split, over tensor parallelism (one output cannot be split): every TP rank sees the same
    final hidden states, so the copies get equal gradients and stay equal. Zero-initialised, so the first
    values are 0 and the backbone starts exactly as the policy. Megatron stores its parameters as replicated
    over TP and DP.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(self, hidden_states, weight=None, **_):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def attach_value_head(model) -> None:
    """Replace the LM head by a value head, untying it from the input embedding on every stage (and chunk)."""
    # Untied everywhere, or the first stage would wait in finalize_model_grads for the embedding-grad
    # all-reduce with a last stage that no longer has an embedding copy.
    for chunk in model_chunks(model):
        chunk.share_embeddings_and_output_weights = False
        if chunk.post_process:
            chunk.output_layer = ValueHead(chunk.config.hidden_size, chunk.config.params_dtype,
                                           next(chunk.parameters()).device)


def value_head_architecture(causal_lm_architecture: str) -> str:
    """The transformers class of the family's model with the value head: `*ForTokenClassification`."""
    return causal_lm_architecture.removesuffix("ForCausalLM") + "ForTokenClassification"
