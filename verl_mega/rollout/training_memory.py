"""Give the actor's training memory back to the accelerator while the colocated rollout generates (`actor.offload`:
verl's grad_offload / optimizer_offload / param_offload), and the critic's (`critic.offload`), idle through the
rollout too (a reference of its own waits on the host outside its own pass with `actor.offload.params`:
`roles.reference`).

Each part `actor.offload` names leaves the device for the rollout window and comes back bitwise before the next
update:
- grads: megatron DDP's contiguous gradient buffers shrink to nothing and regrow zeroed (nothing is copied: the
  next backward refills them);
- optimizer: Adam's moments and step counters wait on the host;
- params: once the rollout engine holds its own copy of the weights (the transition reads them), the parameters,
  their saved buffers and the optimizer's fp32 main parameters wait on the host.
What waits on the host is each storage's bytes: the storage itself is resized to nothing and back, as verl does,
so every tensor keeps its identity and every view stays valid (DDP's per-parameter views of its buffers, the
HybridEngine's, the distributed optimizer's shards). The same code runs on CPU, where the host copy takes what
the storage gave back: it saves nothing there, and it is what the tests exercise.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch

from verl_mega.config.schema import OffloadConfig
from verl_mega.models.builder import checkpoint_tensors, unwrap_model
from verl_mega.models.host_copies import HostCopies


@contextlib.contextmanager
def training_memory_released(model: torch.nn.Module, optimizer, offload: OffloadConfig
                             ) -> Iterator[Callable[[], None]]:
    """For the body, the actor's gradients and optimizer state released as `offload` says; yields `release_params`,
    which the body calls once the rollout engine holds its copy of the weights (it offloads the parameters and the
    fp32 main parameters where `offload.params`, else does nothing). Everything is back on exit."""
    grad_buffers = [buffer.grad_data for buffer in _megatron_grad_buffers(model)] if offload.grads else []
    sizes = [grad.untyped_storage().size() for grad in grad_buffers]
    for grad in grad_buffers:
        grad.untyped_storage().resize_(0)
    if offload.grads:
        for param in model.parameters():
            param.grad = None
    held = HostCopies()
    if offload.optimizer:
        held.offload(_optimizer_state_tensors(optimizer))
    _empty_cache()

    def release_params() -> None:
        if offload.params:
            held.offload([*checkpoint_tensors(unwrap_model(model)).values(), *_main_parameters(optimizer)])
            _empty_cache()

    try:
        yield release_params
    finally:
        held.restore()
        for grad, size in zip(grad_buffers, sizes):
            grad.untyped_storage().resize_(size)
            grad.zero_()
        if torch.cuda.is_available():
            torch.cuda.synchronize()


@contextlib.contextmanager
def models_memory_released(held: Sequence[tuple[torch.nn.Module, object, OffloadConfig]]
                           ) -> Iterator[Callable[[], None]]:
    """`training_memory_released` over each (model, optimizer or None, offload) at once: the actor, and the critic
    and reference that sit idle through the rollout too; the yielded `release_params` releases all their
    parameters."""
    with contextlib.ExitStack() as stack:
        releases = [stack.enter_context(training_memory_released(*each)) for each in held]

        def release_params() -> None:
            for release in releases:
                release()

        yield release_params


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _megatron_grad_buffers(model: torch.nn.Module):
    # megatron's DistributedDataParallel keeps every gradient in a few contiguous buffers.
    # (`buffers` is also nn.Module's method, hence the list check.)
    found = []
    for attribute in ("buffers", "expert_parallel_buffers"):
        value = getattr(model, attribute, None)
        if isinstance(value, list):
            found += value
    return found


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (chained, mixed-precision or distributed) wrappers."""
    if optimizer is None:
        return []
    return [getattr(inner, "optimizer", inner) for inner in getattr(optimizer, "chained_optimizers", [optimizer])]


def _optimizer_state_tensors(optimizer) -> Iterator[torch.Tensor]:
    for torch_optimizer in _torch_optimizers(optimizer):
        for state in torch_optimizer.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def _main_parameters(optimizer) -> Iterator[torch.Tensor]:
    """What the torch optimizers step: the fp32 main parameters (whole, or the distributed optimizer's shards), or
    for an fp32 model the parameters themselves (their storage then offloaded once)."""
    for torch_optimizer in _torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            yield from group["params"]
