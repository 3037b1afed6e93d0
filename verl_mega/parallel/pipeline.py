"""Run micro-batches through megatron's pipeline schedules (any PP, including 1)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def forward_only_outputs(model, micro_batches: Sequence[dict], step: Callable[[torch.nn.Module, dict], torch.Tensor],
                         collect: Callable[[torch.Tensor, dict], object]) -> list | None:
    """Forward every micro-batch through the pipeline without gradients.

    `step(model, batch)` runs this stage's forward; on the last stage `collect(output, batch)` turns its
    output into what is returned (one item per micro-batch). Other stages return None.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = iter(micro_batches)

    def forward_step(data_iterator, stage_model):
        batch = next(data_iterator)
        output = step(stage_model, batch)
        return output, lambda out, non_loss_data=True: collect(out, batch)

    first = micro_batches[0]["input_ids"]
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=first.shape[1],
            micro_batch_size=first.shape[0],
            forward_only=True,
            collect_non_loss_data=True,
        )
    return outputs if parallel_state.is_pipeline_last_stage() else None
