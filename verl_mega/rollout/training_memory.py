"""Give the actor's gradient and optimizer memory back to the accelerator while the rollout generates.

Gradients are dropped (the next backward refills them; megatron's contiguous grad buffers are shrunk to
nothing and regrown zeroed); optimizer state waits on the host. On CPU there is nothing to give back, so
the context runs its body unchanged, which keeps the call sites identical on both.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def training_memory_released(model: torch.nn.Module, optimizer=None):
    if not torch.cuda.is_available():
        yield
        return
    grad_buffers = [buffer.grad_data for buffer in _megatron_grad_buffers(model)]
    sizes = [grad.untyped_storage().size() for grad in grad_buffers]
    for grad in grad_buffers:
        grad.untyped_storage().resize_(0)
    for param in model.parameters():
        param.grad = None
    states = _optimizer_state_to_host(optimizer)
    torch.cuda.empty_cache()
    try:
        yield
    finally:
        for grad, size in zip(grad_buffers, sizes):
            grad.untyped_storage().resize_(size)
            grad.zero_()
        for holder, key, device in states:
            holder[key] = holder[key].to(device)
        torch.cuda.synchronize()


def _megatron_grad_buffers(model: torch.nn.Module):
    # megatron's DistributedDataParallel keeps every gradient in a few contiguous buffers.
    # (`buffers` is also nn.Module's method, hence the list check.)
    found = []
    for attribute in ("buffers", "expert_parallel_buffers"):
        value = getattr(model, attribute, None)
        if isinstance(value, list):
            found += value
    return found


def _optimizer_state_to_host(optimizer) -> list[tuple[dict, str, torch.device]]:
    """Move each state tensor to the host; returns where each came from (no device tensor stays referenced)."""
    moved = []
    for holder, key, tensor in _optimizer_state_tensors(optimizer):
        moved.append((holder, key, tensor.device))
        holder[key] = tensor.to("cpu")
    return moved


def _optimizer_state_tensors(optimizer):
    """(dict, key, tensor) for each state tensor; megatron's optimizers wrap torch ones (`.optimizer`)."""
    if optimizer is None:
        return
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", inner)
        for state in torch_optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    yield state, key, value
