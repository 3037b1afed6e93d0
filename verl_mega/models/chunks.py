"""A pipeline rank's model under virtual pipeline stages (megatron's interleaved schedule): the GPTModel of each
virtual stage the rank runs, its *chunks*, held as one module.

Whatever walks a rank's model (checkpoints, the HybridEngine, LoRA, routing replay, offload) then sees one
tree, its tensors named `chunks.C.<megatron name in chunk C>` (`sharding.rank_slots`); only the pipeline
schedules take the chunks apart (`schedule_chunks`). Without virtual stages the rank's model is the GPTModel
itself, named as before.
"""
from __future__ import annotations

from typing import Sequence

import torch

CHUNKS = "chunks"


def chunk_prefix(chunk: int) -> str:
    return f"{CHUNKS}.{chunk}."


class StageChunks(torch.nn.Module):
    """The model chunks of one pipeline rank, in virtual-stage order; they share one TransformerConfig."""

    def __init__(self, chunks: Sequence[torch.nn.Module]):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)
        self.config = chunks[0].config
        self.model_type = chunks[0].model_type

    # What megatron's finalize_model_grads reads of a rank's model: the embedding tied to the output layer is
    # the first chunk's on the first stage and the last chunk's on the last.
    @property
    def pre_process(self) -> bool:
        return self.chunks[0].pre_process

    @property
    def post_process(self) -> bool:
        return self.chunks[-1].post_process

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.chunks[0].share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        return (self.chunks[0] if self.pre_process else self.chunks[-1]).shared_embedding_or_output_weight()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The chunks' sharded state dicts under this module's names; each chunk's checkpoint keys already carry
        its global layer numbers, so the checkpoint is the same as without virtual stages."""
        merged = {}
        for index, chunk in enumerate(self.chunks):
            state = chunk.sharded_state_dict(sharded_offsets=sharded_offsets, metadata=metadata)
            merged.update({f"{prefix}{chunk_prefix(index)}{key}": value for key, value in state.items()})
        return merged

    def forward(self, *args, **kwargs):
        raise TypeError("a rank's model chunks run one at a time, through megatron's interleaved schedule "
                        "(schedule_chunks)")


def model_chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The GPTModels of a rank's (unwrapped) model, in virtual-stage order: its chunks, or the model itself."""
    return list(model.chunks) if isinstance(model, StageChunks) else [model]


def schedule_chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model list megatron's schedules take: a rank's chunks (inside the DDP that a trainable role wraps them
    all in), or `[model]` as it is."""
    inner = getattr(model, "module", model)
    return list(inner.chunks) if isinstance(inner, StageChunks) else [model]
