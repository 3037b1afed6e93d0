"""Run micro-batches through megatron's pipeline schedules (any PP, including 1, with or without virtual
pipeline stages)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def interleaved_group_size(micro_batches: int, pp: int) -> int:
    """megatron's `microbatch_group_size_per_vp_stage` for a pass of `micro_batches`: the micro-batches each
    chunk runs in a row. Its default, pp (the schedule the memory planner counts), where pp divides them; else
    the smallest group the interleaved schedule accepts (it needs the last group empty or of at least pp)."""
    for group in range(pp, micro_batches + 1):
        if micro_batches % group == 0 or micro_batches % group >= pp:
            return group
    raise ValueError(f"virtual pipeline stages need at least pp={pp} micro-batches in each pass; this one has "
                     f"{micro_batches}: give each data-parallel rank at least {pp} micro-batches (more rows, or a "
                     "smaller micro-batch size), or set parallel.vpp=1")


def run_schedule(chunks: Sequence[torch.nn.Module], micro_batches: Sequence[dict], forward_step: Callable,
                 forward_only: bool, **options):
    """megatron's schedule for a rank's model list `chunks` (its model, or its virtual stages' chunks, which
    run interleaved) over `micro_batches`; `forward_step(data_iterator, chunk)` as megatron takes it. Each chunk
    reads every micro-batch in order from its own iterator."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    batches = iter(micro_batches)
    if len(chunks) > 1:
        batches = [iter(micro_batches) for _ in chunks]
        get_model_config(chunks[0]).microbatch_group_size_per_vp_stage = interleaved_group_size(
            len(micro_batches), parallel_state.get_pipeline_model_parallel_world_size())
    first = micro_batches[0]["input_ids"]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=list(chunks),
        num_microbatches=len(micro_batches),
        seq_length=first.shape[1],
        micro_batch_size=first.shape[0],
        forward_only=forward_only,
        **options,
    )


def forward_only_outputs(chunks: Sequence[torch.nn.Module], micro_batches: Sequence[dict],
                         step: Callable[[torch.nn.Module, dict], torch.Tensor],
                         collect: Callable[[torch.Tensor, dict], object]) -> list | None:
    """Forward every micro-batch through the pipeline without gradients.

    `step(chunk, batch)` runs a chunk's forward (the rank's model's at one virtual stage); on the last stage
    `collect(output, batch)` turns its output into what is returned (one item per micro-batch). Other stages
    return None.
    """
    from megatron.core import parallel_state

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        output = step(chunk, batch)
        return output, lambda out, non_loss_data=True: collect(out, batch)

    with torch.no_grad():
        outputs = run_schedule(chunks, micro_batches, forward_step, forward_only=True, collect_non_loss_data=True)
    return outputs if parallel_state.is_pipeline_last_stage() else None
