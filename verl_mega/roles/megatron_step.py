"""Micro-batched forward and forward+backward passes through megatron's pipeline schedules, for every role.

The actor, critic and reference differ only in what they compute from the last stage's output; this module
owns the rest: slicing the global batch over data parallelism, splitting micro-batches, the attention mask,
the pipeline schedule, and bringing results from the last pipeline stage (and every DP rank) to all ranks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from verl_mega.algorithms import agg_units
from verl_mega.config import ConfigError
from verl_mega.data.packing import PackedRows, pack, pack_layout
from verl_mega.models.builder import takes_packed_rows, unwrap_model, uses_transformer_engine
from verl_mega.models.chunks import schedule_chunks
from verl_mega.parallel.context_parallel import gather_sequence, sequence_multiple, split_for_rank
from verl_mega.parallel.pipeline import forward_only_outputs, run_schedule
from verl_mega.parallel.shims import cuda_device_rewrite_paused
from verl_mega.parallel.state import current_layout, device

from .batching import Batch, causal_padding_mask, dp_slice, global_agg_units, micro_batches, pad_response_columns
from .routing_replay import (
    NOT_RECORDED, ROUTED_EXPERTS, check_routed_experts, forget_kept_routes, replaying, sequence_first,
)


def stage_forward(stage_model, micro_batch: Batch, packed: bool = False) -> torch.Tensor:
    """This pipeline stage's forward. The last stage returns only its outputs at the R positions that predict
    the response tokens (R = the micro-batch's response width): [b, R, V/tp] logits, or the role's head output.
    `packed`: the rows go through as one padding-free THD row (transformer-engine layers only).
    The rows the model sees follow `model_rows`; what the last stage returns does not depend on them."""
    return forward_rows(stage_model, model_rows(micro_batch, uses_transformer_engine(stage_model), packed))


def forward_rows(stage_model, rows: ModelRows) -> torch.Tensor:
    """`stage_forward` of rows already laid out for the model. The model's forward passes no literal CUDA
    device, so it runs without the CPU shims' per-op hook."""
    here = device()
    extra = {} if rows.packed_seq_params is None else {"packed_seq_params": rows.packed_seq_params.to(here)}
    with (cuda_device_rewrite_paused(), _output_layer_at(stage_model, rows.response_positions.to(here)),
          replaying(stage_model, rows.routed_experts)):
        return stage_model(
            rows.input_ids.to(here),
            rows.position_ids.to(here),
            None if rows.attention_mask is None else rows.attention_mask.to(here),
            **extra,
        )


@dataclass(frozen=True)
class ModelRows:
    """A micro-batch as the model's forward takes it, and where its outputs that predict the responses lie."""

    input_ids: torch.Tensor  # [b', s]
    position_ids: torch.Tensor  # [b', s]
    attention_mask: torch.Tensor | None  # megatron's [b, 1, s, s] (True = may not attend), or none at all
    packed_seq_params: _PackedSeqParams | None
    # [b, R] long: for each response-predicting column of the padded layout (`response_window`), its position
    # in the last stage's sequence-first [s, b', ...] output flattened to [s * b', ...]
    response_positions: torch.Tensor
    # [s * b', moe_layers, top_k]: the rollout's experts of each token in that order (routing replay), or None
    routed_experts: torch.Tensor | None = None


def model_rows(micro_batch: Batch, transformer_engine: bool, packed: bool) -> ModelRows:
    """The padded layout (a left-padded prompt followed by its right-padded response) as the layers need it.

    megatron's local layers take it as it is with `causal_padding_mask`. transformer-engine's attention (flash,
    cuDNN) ignores a mask under the causal mask type, and its padding mask types describe padding at the end
    of each row (the cuDNN kernels take sequence lengths only), so it never gets left padding: each row is
    rotated to start at its first token (right-aligned rows, causal mask type, no mask, where no real token
    follows padding), or the rows are packed into one THD row (`packed`). The rotation changes no attention
    score: megatron's RoPE depends on position differences only (see `causal_padding_mask`). Under context
    parallelism (transformer-engine's attention, right-aligned rows) the model takes this CP rank's part of each
    row (`context_parallel.split_for_rank`); the response positions stay those of the whole rows, which the last
    stage gathers back (`_output_layer_at`)."""
    if packed:
        return _packed_rows(micro_batch)
    if transformer_engine:
        return _right_aligned_rows(micro_batch)
    ids, mask = micro_batch["input_ids"], micro_batch["attention_mask"]
    unrotated = torch.zeros(ids.shape[0], dtype=torch.long)
    routes = micro_batch.get(ROUTED_EXPERTS)
    return ModelRows(ids, micro_batch["position_ids"], causal_padding_mask(mask), None,
                     _rotated_response_positions(unrotated, ids.shape[1], micro_batch["responses"].shape[1]),
                     None if routes is None else sequence_first(routes))


def _right_aligned_rows(micro_batch: Batch) -> ModelRows:
    ids, mask = micro_batch["input_ids"], micro_batch["attention_mask"]
    rows, width = ids.shape
    first_token = pack_layout(mask).row_starts
    columns = (torch.arange(width) + first_token[:, None]) % width
    routes = micro_batch.get(ROUTED_EXPERTS)
    layout = current_layout()
    on_this_cp_rank = partial(split_for_rank, cp=layout.cp, rank=layout.cp_rank)
    return ModelRows(on_this_cp_rank(ids.gather(1, columns)),
                     on_this_cp_rank(micro_batch["position_ids"].gather(1, columns)), None, None,
                     _rotated_response_positions(first_token, width, micro_batch["responses"].shape[1]),
                     None if routes is None else sequence_first(on_this_cp_rank(
                         routes[torch.arange(rows)[:, None], columns])))


def _rotated_response_positions(shift: torch.Tensor, width: int, response_length: int) -> torch.Tensor:
    """Rows rotated left by `shift` [b]: where each row's response-predicting columns went, flattened
    sequence-first."""
    rows = len(shift)
    columns = torch.arange(width - response_length - 1, width - 1)
    return ((columns[None, :] - shift[:, None]) % width) * rows + torch.arange(rows)[:, None]


def _packed_rows(micro_batch: Batch) -> ModelRows:
    """Each row's run of tokens packed back to back (the last stage's output is [T, 1, ...]); a response-
    predicting column outside its row's run (the response's padding) reads the run's nearest token, whose
    output the loss masks."""
    layout = pack_layout(micro_batch["attention_mask"], multiple_of=_packed_run_multiple())
    width, response_length = layout.width, micro_batch["responses"].shape[1]
    columns = torch.arange(width - response_length - 1, width - 1)
    offsets = columns[None, :] - layout.row_starts[:, None]
    offsets = torch.minimum(offsets.clamp_min(0), (layout.lengths - 1).clamp_min(0)[:, None])
    positions = (layout.cu_seqlens_padded[:-1].long()[:, None] + offsets).clamp(0, max(layout.total - 1, 0))
    routes = micro_batch.get(ROUTED_EXPERTS)
    return ModelRows(pack(micro_batch["input_ids"], layout), layout.position_ids(), None,
                     _PackedSeqParams(layout), positions,
                     None if routes is None else pack(routes, layout, fill=NOT_RECORDED)[0])


@dataclass(frozen=True)
class _PackedSeqParams:
    layout: PackedRows

    def to(self, here):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu_seqlens = self.layout.cu_seqlens.to(here)
        cu_seqlens_padded = self.layout.cu_seqlens_padded.to(here)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                               cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                               max_seqlen_q=self.layout.max_seqlen, max_seqlen_kv=self.layout.max_seqlen)


@contextlib.contextmanager
def _output_layer_at(stage_model, response_positions: torch.Tensor):
    """The output layer (LM or value head) applied to the hidden states at `response_positions` only (see
    `ModelRows`): the prompt's outputs are never read, and on long prompts they are most of the [b, s, V]
    logits' time and memory (packed: a [T, V] row and its padded [b, L, V] copy)."""
    output_layer = getattr(unwrap_model(stage_model), "output_layer", None)
    if output_layer is None:  # not the last pipeline stage
        yield
        return

    # The gathered hidden states go in batch-first and their outputs come back as a sequence-first view: megatron's
    # closing `transpose(0, 1).contiguous()` then finds them contiguous and copies nothing, where it copied the
    # whole [R, b, V] logits forward and again backward (3-8 % of a 100M model's update, more with a larger V).
    # The output layer multiplies along the last dimension only, so the order of the others is free.
    # Under sequence parallelism the last norm's output is this TP rank's shard of the sequence: the shards are
    # gathered first (the backward keeps this rank's part of the gradient), and the LM head, which would gather
    # them itself, runs as without it for that call (its input gradient is then all-reduced over TP), as
    # megatron's GPTModel does when it keeps only the last token's logits.
    # Under context parallelism the hidden states are then this CP rank's chunks of the sequence (`model_rows`):
    # every CP rank gathers the whole sequence and computes the whole loss from it (the gather's backward sums the
    # ranks' gradients, and `forward_backward` undoes the schedule's x CP), so each role's loss is unchanged.
    config = unwrap_model(stage_model).config
    split = config.sequence_parallel
    unsplit_head = split and getattr(output_layer, "sequence_parallel", False)

    def gather_batch_first(module, args, kwargs):
        hidden_states = args[0]  # [s, b', h], megatron's sequence-first layout
        if split:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        if config.context_parallel_size > 1:
            from megatron.core import parallel_state as ps

            hidden_states = gather_sequence(hidden_states, ps.get_context_parallel_group(), dim=0)
        return (hidden_states.flatten(0, 1)[response_positions], *args[1:]), kwargs

    def as_sequence_first(module, args, output):
        outputs, bias = output
        return outputs.transpose(0, 1), bias

    handles = [output_layer.register_forward_pre_hook(gather_batch_first, with_kwargs=True),
               output_layer.register_forward_hook(as_sequence_first)]
    if unsplit_head:
        output_layer.sequence_parallel = False
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if unsplit_head:
            output_layer.sequence_parallel = True


def sequence_split(model) -> int:
    """Over how many ranks the model's forward splits the sequence: the TP size under sequence parallelism."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def columns_multiple(model) -> int:
    """What each micro-batch's columns are padded to a multiple of: the sequence split (`sequence_split`) of each
    of context parallelism's 2 x CP equal chunks."""
    from megatron.core.utils import get_model_config

    return sequence_split(model) * sequence_multiple(get_model_config(model).context_parallel_size)


def _packed_run_multiple() -> int:
    """Each run is padded to a multiple of the tensor-parallel size, so that under sequence parallelism the
    packed row splits evenly over the TP ranks."""
    return current_layout().tp


PACKING_SETTINGS = ("auto", "true", "false")


def resolve_sequence_packing(setting: str, model, key: str) -> bool:
    """`setting` (auto | true | false, the config's `key`) -> whether this model's passes pack their rows.
    auto: whenever the layers are transformer-engine's, attention included (`takes_packed_rows`), micro-batches
    may vary in shape (packed rows differ in length) and the model is bf16/fp16, the dtypes of the flash and
    cuDNN attention kernels that take THD input (in fp32 only some transformer-engine releases can); true
    refuses a model without the first two."""
    setting = str(setting).lower()
    if setting not in PACKING_SETTINGS:
        raise ConfigError(f"{key}={setting!r} must be one of {', '.join(PACKING_SETTINGS)}")
    if setting == "false":
        return False
    possible = takes_packed_rows(model)
    if setting == "true" and not possible:
        raise ConfigError(f"{key}=true needs transformer-engine's layers (THD packed attention, on a GPU with "
                          "transformer-engine installed); this model runs megatron's local attention: set it to "
                          "auto or false")
    if not possible:
        return False
    if current_layout().cp > 1:  # a packed row would split over the CP ranks sequence by sequence: not done
        if setting == "true":
            raise ConfigError(f"{key}=true is not supported with parallel.cp > 1 (the packed row is not split "
                              "over the context-parallel ranks): set it to auto or false")
        return False
    if not shapes_may_vary(model):
        if setting == "true":
            raise ConfigError(f"{key}=true needs micro-batches of varying shape, which this model's pipeline "
                              "cannot exchange (pipeline parallelism without variable_seq_lengths): set it to auto "
                              "or false")
        return False
    if setting == "auto":
        from megatron.core.utils import get_model_config

        config = get_model_config(model)
        return bool(config.bf16 or config.fp16)
    return True


def shapes_may_vary(model) -> bool:
    """Whether micro-batches may differ in shape: not under expert parallelism with the all-gather token
    dispatcher (CPU's), which gathers equal-shaped tokens from every expert-parallel rank, each holding other
    rows; otherwise always without pipeline parallelism, and across pipeline stages only when megatron
    exchanges each tensor's shape first (`variable_seq_lengths`)."""
    from megatron.core.utils import get_model_config

    config, layout = get_model_config(model), current_layout()
    if layout.ep > 1 and config.moe_token_dispatcher_type == "allgather":
        return False
    return layout.pp == 1 or config.variable_seq_lengths


def compute_per_token(model, batch: Batch, micro_batch_size: int, output_names: Sequence[str],
                      per_token: Callable[[torch.Tensor, Batch], dict[str, torch.Tensor]], max_tokens: int = 0,
                      packed: bool = False, values_per_token: dict[str, int] | None = None
                      ) -> dict[str, torch.Tensor]:
    """Forward-only: `per_token(last_stage_output, micro_batch)` gives float32 [b, r] tensors named
    `output_names` (r: the micro-batch's trimmed response width); returns them as [B, R] for the whole global
    batch on every rank. `max_tokens`: a token budget per micro-batch instead of `micro_batch_size` rows.
    `packed`: see `stage_forward`. `values_per_token`: name -> k for outputs of k values per token, given as
    [b, r * k] (token-major) and returned as [B, R * k]."""
    from megatron.core import parallel_state as ps

    layout = current_layout()
    check_routed_experts(model, batch)
    local = dp_slice(batch, layout.dp_rank, layout.dp)
    pieces = micro_batches(local, micro_batch_size, max_tokens, trim=shapes_may_vary(model),
                           columns_multiple_of=columns_multiple(model))
    outputs = forward_only_outputs(schedule_chunks(model), pieces, partial(stage_forward, packed=packed), per_token)
    rows, response_length = tuple(local["responses"].shape)
    results = {}
    for name in output_names:
        # The trimmed columns are the last ones: token-major, their values are the last ones too.
        shape = (rows, response_length * (values_per_token or {}).get(name, 1))
        if outputs is not None:
            tensor = torch.cat([pad_response_columns(output[name].float(), shape[1]) for output in outputs])
            tensor = tensor.to(device()).contiguous()
        else:
            tensor = torch.empty(shape, dtype=torch.float32, device=device())
        if layout.pp > 1:
            dist.broadcast(tensor, ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        results[name] = _gather_over_dp(tensor, layout.dp)
    return results


def _gather_over_dp(tensor: torch.Tensor, dp: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if dp == 1:
        return tensor
    pieces = [torch.empty_like(tensor) for _ in range(dp)]
    dist.all_gather(pieces, tensor, group=ps.get_data_parallel_group())
    return torch.cat(pieces)


@dataclass(frozen=True)
class MicroBatchShare:
    """This micro-batch's fraction of the mini-batch (all DP ranks): of its loss-aggregation units, which
    weights its aggregated loss, and of its response tokens, which weights token-mean metrics."""

    loss: torch.Tensor
    tokens: torch.Tensor


LossFn = Callable[[torch.Tensor, Batch, MicroBatchShare], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def forward_backward(model, mini_batch: Batch, micro_batch_size: int, loss_agg_mode: str, metric_names: Sequence[str],
                     loss_fn: LossFn, max_tokens: int = 0, packed: bool = False) -> dict[str, float]:
    """Accumulate the gradient of one global mini-batch's loss into `model`'s grad buffers.

    `mini_batch` is the global mini-batch; each DP rank takes its slice. `loss_fn(output, micro_batch, share)`
    returns the micro-batch's contribution to the mini-batch loss (its aggregated loss times `share.loss`) and
    metrics already weighted by a share; contributions add up to the mini-batch values over micro-batches
    and DP ranks, so the loss, its gradient and the metrics do not depend on the layout or micro-batch size,
    nor on a token budget (`max_tokens`) grouping the rows instead, which may give DP ranks different numbers
    of micro-batches. `packed`: see `stage_forward`. Returns the summed metrics on every rank.
    """
    from megatron.core import parallel_state as ps

    layout = current_layout()
    check_routed_experts(model, mini_batch)
    forget_kept_routes(model)
    local = dp_slice(mini_batch, layout.dp_rank, layout.dp)
    pieces = micro_batches(local, micro_batch_size, max_tokens, trim=shapes_may_vary(model),
                           columns_multiple_of=columns_multiple(model))
    dp_group = ps.get_data_parallel_group()
    total_units = global_agg_units(local["response_mask"], loss_agg_mode, dp_group)
    total_tokens = global_agg_units(local["response_mask"], "token-mean", dp_group)
    # Megatron divides each micro-batch loss by their number and DDP averages gradients over DP; both undone
    # here because the shares already sum to one over the global mini-batch. Under context parallelism megatron's
    # schedule also multiplies each loss by CP (in Megatron-LM a CP rank's loss is its part's sum), undone too:
    # here each CP rank computes the whole loss (`_output_layer_at`), and the gather's backward, which sums the
    # CP ranks' gradients, with DDP's average over DP x CP gives the whole loss's gradient.
    undo_averaging = len(pieces) * layout.dp / layout.cp

    def forward_step(data_iterator, stage_model):
        micro_batch = next(data_iterator)
        output = stage_forward(stage_model, micro_batch, packed)

        def loss_func(output_tensor):
            response_mask = micro_batch["response_mask"].to(output_tensor.device)
            share = MicroBatchShare(
                loss=agg_units(response_mask, loss_agg_mode) / total_units.clamp_min(1),
                tokens=agg_units(response_mask, "token-mean") / total_tokens.clamp_min(1),
            )
            loss, metrics = loss_fn(output_tensor, micro_batch, share)
            return loss * undo_averaging, {name: value.detach().float() for name, value in metrics.items()}

        return output, loss_func

    per_micro_batch = run_schedule(schedule_chunks(model), pieces, forward_step, forward_only=False)
    sums = torch.zeros(len(metric_names), dtype=torch.float64, device=device())
    if ps.is_pipeline_last_stage():
        for metrics in per_micro_batch:
            sums += torch.stack([metrics[name].double() for name in metric_names])
    dist.all_reduce(sums, group=dp_group)
    if layout.pp > 1:
        dist.broadcast(sums, ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return dict(zip(metric_names, sums.tolist()))
