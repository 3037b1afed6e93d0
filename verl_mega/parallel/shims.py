"""The few places where megatron-core assumes CUDA or transformer-engine, made to run without them.

`apply_shims()` changes nothing on a GPU node with transformer-engine, so such runs execute unmodified
megatron-core. On CPU each patch below stands in for one CUDA assumption, and its comment names the
megatron-core code it stands in for and what fails without it. Each holds for every supported release (0.16.1 up
to 0.19.x, `megatron_versions.SUPPORTED`) unless its comment names the releases that need it; a patch that only
some releases need asks `megatron_versions.since`.

Routing replay needs no patch: it sets megatron-core's own `TopKRouter.router_replay` hook (the object whose
`get_replay_topk` the unfused top-k routing calls; 0.16 and Megatron-LM's main of Aug 2026, 0.20, alike), on
CPU and GPU the same way; see `roles.routing_replay`.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch.overrides import TorchFunctionMode

from . import megatron_versions

_applied = False
_device_mode: TorchFunctionMode | None = None  # the process-wide mode below, once the CPU shims are applied


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites literal `device="cuda"` arguments (schedules, grad-norm, optimizer set-up) to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.cuda,):
            return args[0]
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _DropCpuRngWarning(logging.Filter):
    # On CPU the "CUDA" RNG is the CPU RNG, so megatron's fork() always sees the CPU state move.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def apply_shims() -> None:
    """Idempotent: patch what is missing in this process (transformer-engine, CUDA), nothing else."""
    global _applied
    if _applied:
        return
    _applied = True
    _fix_moe_router_without_transformer_engine()
    _fix_mla_without_transformer_engine()
    _allow_sequence_parallel_torch_norms()
    if not torch.cuda.is_available():
        _apply_cpu_shims()


def use_fused_adam(optimizer) -> None:
    """Megatron expects transformer-engine's or apex's fused Adam; without them it builds torch's AdamW with
    torch's defaults, which loop over the tensors on the CPU (0.36-0.54 s per step for 100M parameters, against
    0.07 s fused, 2 threads). This switches such an optimizer to torch's fused kernel, on any device.
    Idempotent: loading a checkpoint restores the groups' saved settings and step counters, so it runs again
    after a load."""
    for sub_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub_optimizer.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            group.update(fused=True, foreach=False)
            for param in group["params"]:
                state = inner.state.get(param, {})
                if "step" in state:  # the fused kernel reads the counter on the parameter's device
                    state["step"] = state["step"].to(param.device, torch.float32)


def accumulate_weight_gradients_in_place(model) -> None:
    """Where the CPU shims are applied, the megatron linear layers of a DDP-wrapped `model` add each weight
    gradient into DDP's gradient buffer inside the GEMM (megatron's gradient_accumulation_fusion, which on a
    GPU needs apex's CUDA module). Unfused, every backward writes a weight-sized gradient (the LM head's alone
    is 50 MB for a 100M model, faulted in page by page) and DDP's hook adds it in a second pass; fused, autograd
    gets an untouched placeholder. Call after wrapping: the fused path writes to `main_grad`, which only DDP
    creates."""
    if _device_mode is None:  # no CPU shims: a GPU keeps megatron's configured path
        return
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            module.gradient_accumulation_fusion = True


class _WeightGradientIntoMainGrad:
    """apex's fused_weight_gradient_mlp_cuda, as megatron's linear backward calls it: main_grad += dY^T X."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        if total_input.dtype == main_grad.dtype:
            main_grad.addmm_(grad_output.t(), total_input)
        else:  # bf16/fp16 activations into an fp32 buffer: the GEMM in their dtype, as the unfused path
            main_grad.add_(grad_output.t() @ total_input)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def _fix_moe_router_without_transformer_engine() -> None:
    # megatron-core 0.16's moe_utils leaves `te_general_gemm` undefined (not None) when transformer-engine is
    # absent; 0.17 and newer set it to None themselves.
    if megatron_versions.since("moe_utils_defines_te_general_gemm"):
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _fix_mla_without_transformer_engine() -> None:
    # multi_latent_attention sets HAVE_TE when megatron's transformer-engine extension imports, which it does without
    # transformer-engine (its TELinear is then a MagicMock, which isinstance refuses as a type).
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


def _allow_sequence_parallel_torch_norms() -> None:
    # megatron's local layer spec builds its norms with WrappedTorchNorm, which asserts `not sequence_parallel`
    # (transformer-engine's TENorm accepts it). A norm is per token, so it computes the same on a sequence
    # shard; what sequence parallelism changes is that each TP rank's weight gradient covers only its shard,
    # and finalize_model_grads sums over the TP group the gradients of the parameters marked `sequence_parallel`,
    # as TENorm marks them. This builds the torch norm from the config without the flag and marks its weight.
    import copy

    from megatron.core.transformer import torch_norm

    build = torch_norm.WrappedTorchNorm.__new__
    if getattr(build, "marks_sequence_parallel", False):
        return

    @functools.wraps(build)
    def build_marked(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, *args, **kwargs)
        unsplit = copy.copy(config)  # a shallow copy: no __post_init__ validation to run again
        unsplit.sequence_parallel = False
        norm = build(cls, unsplit, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    build_marked.marks_sequence_parallel = True
    torch_norm.WrappedTorchNorm.__new__ = build_marked


def _apply_cpu_shims() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.tensor_parallel import layers as tensor_parallel_layers
    from megatron.core.tensor_parallel import random as mp_random

    # Used as a `device=` argument for rotary tables, pipeline receive buffers and TP buffers.
    torch.cuda.current_device = lambda: "cpu"
    # Called after pipeline shape exchange and around checkpoint saving.
    torch.cuda.synchronize = lambda device=None: None
    # From 0.19 on, DDP's grad sync (param_and_grad_buffer.start_grad_sync) waits on the current stream's CUDA
    # graph events at every step (0.17 and 0.18 only with several distributed-optimizer instances and overlap):
    # torch's CPU stream, whose waits are no-ops, stands in.
    torch.cuda.current_stream = lambda device=None: torch.cpu.current_stream()
    # The model-parallel RNG tracker forks "CUDA" RNG states even with dropout 0: back them with the CPU RNG.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    logging.getLogger(mp_random.__name__).addFilter(_DropCpuRngWarning())
    # clip_grad_by_total_norm_fp32 asserts `grad.type() == 'torch.cuda.FloatTensor'`.
    # optimizer.py imported the function by name, so its reference is replaced too.
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm
    megatron_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm
    _patch_optimizer_cuda_type_checks()
    # Stands in for apex's fused wgrad kernel, which megatron's linear layers import by this name.
    tensor_parallel_layers.fused_weight_gradient_mlp_cuda = _WeightGradientIntoMainGrad
    # Literal "cuda" devices elsewhere: a function mode for the life of the process.
    global _device_mode
    _device_mode = _CudaDeviceToCpu()
    _device_mode.__enter__()
    _run_without_device_rewrite_where_no_cuda_literal()


@contextlib.contextmanager
def cuda_device_rewrite_paused():
    """Runs code that passes no literal CUDA device (transformers' `generate`) without the process-wide device
    mode: its Python hook on every torch call doubled the embedded engine's decode time on the tiny model.
    A no-op where the mode is not applied (GPU) or is not the innermost function mode."""
    if _device_mode is None or torch.overrides._get_current_function_mode() is not _device_mode:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def _run_without_device_rewrite_where_no_cuda_literal() -> None:
    # The backward pass and torch's optimizer steps name no device, yet make most of a training step's torch
    # calls on a small model: the mode's Python hook on each of them took ~10 % of the tiny model's update.
    from megatron.core.pipeline_parallel import schedules

    schedules.backward_step = _without_device_rewrite(schedules.backward_step)
    for optimizer_class in (torch.optim.AdamW, torch.optim.SGD):
        optimizer_class.step = _without_device_rewrite(optimizer_class.step)


def _without_device_rewrite(function):
    @functools.wraps(function)
    def run(*args, **kwargs):
        with cuda_device_rewrite_paused():
            return function(*args, **kwargs)

    return run


def _clip_grad_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [
        (p.decoupled_grad if use_decoupled_grad else p.grad).detach()
        for p in parameters
        if (p.decoupled_grad if use_decoupled_grad else p.grad) is not None
    ]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def _patch_optimizer_cuda_type_checks() -> None:
    """The fp16/bf16 and distributed optimizers accept params only if `p.type()` names a torch.cuda tensor."""
    from megatron.core.optimizer import distrib_optimizer, optimizer

    for module, cls_name in ((optimizer, "Float16OptimizerWithFloat16Params"),
                             (distrib_optimizer, "DistributedOptimizer")):
        cls = getattr(module, cls_name, None)
        if cls is None:
            continue
        original_init = cls.__init__

        @functools.wraps(original_init)
        def init_with_cuda_type_names(self, *args, __original=original_init, **kwargs):
            with _cuda_type_names():
                __original(self, *args, **kwargs)

        cls.__init__ = init_with_cuda_type_names


@contextlib.contextmanager
def _cuda_type_names():
    original_type = torch.Tensor.type

    def cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is not None:
            return original_type(self, dtype, non_blocking, **kwargs)
        name = original_type(self)
        # The device function mode re-dispatches Tensor.type through this patch once more: rename only once.
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_named_type
    try:
        yield
    finally:
        torch.Tensor.type = original_type
