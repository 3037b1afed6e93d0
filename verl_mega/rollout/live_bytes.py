"""Measure the bytes of tensor storage a block of code allocates and keeps alive, peak included.

A dispatch mode sees every tensor an op returns. Storage that did not exist before (not shared with any
input of the op) is counted until the last tensor the mode saw on it is garbage-collected, so views and
in-place results of pre-existing tensors (the model's parameters) never count. Works on CPU, where there
are no allocator statistics; on a GPU it measures the same thing `max_memory_allocated` would, restricted
to the tracked code.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """`with tracker:` around allocating code; `now` / `peak` are the tracked live bytes."""

    def __init__(self):
        super().__init__()
        self.now = 0
        self.peak = 0
        self._refs: dict[int, int] = {}  # storage address -> tracked tensors still alive on it

    def reset_peak(self) -> None:
        self.peak = self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_address(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._see(tensor, inputs)
        return out

    def _see(self, tensor: torch.Tensor, input_addresses: set[int]) -> None:
        address = _address(tensor)
        if address in self._refs:
            self._refs[address] += 1
        elif address in input_addresses or tensor.untyped_storage().nbytes() == 0:
            return  # a view or in-place result of something allocated elsewhere
        else:
            self._refs[address] = 1
            self.now += tensor.untyped_storage().nbytes()
            self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._forget, address, tensor.untyped_storage().nbytes())

    def _forget(self, address: int, nbytes: int) -> None:
        self._refs[address] -= 1
        if self._refs[address] == 0:
            del self._refs[address]
            self.now -= nbytes


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
