"""Storages whose bytes wait on the host while the device needs the room (verl's param/grad/optimizer offload):
each storage is resized to nothing and back, so every tensor keeps its identity and every view stays valid.
Used across the rollout window (`rollout.training_memory`) and by a reference kept on the host outside its own
pass (`roles.reference`). On CPU the host copy takes what the storage gave back: it saves nothing there, and it
is what the tests exercise."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch


class HostCopies:
    """Storages whose bytes wait on the host (`offload`), each resized to nothing until `restore`."""

    def __init__(self):
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        return sum(host.numel() for _, host in self._held)

    def offload(self, tensors: Iterable[torch.Tensor]) -> None:
        """Each distinct non-empty storage under `tensors` once (views of one buffer share it); with a GPU, only
        those on it (megatron's CPU-offloaded optimizer keeps its state on the host already)."""
        pinned = torch.cuda.is_available()
        for storage in _distinct_storages(tensors):
            if pinned and storage.device.type == "cpu":
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pinned)
            host.copy_(_as_bytes(storage))
            storage.resize_(0)
            self._held.append((storage, host))

    def restore(self) -> None:
        for storage, host in self._held:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host)
        self._held.clear()


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> Iterator[torch.UntypedStorage]:
    seen = set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            yield storage


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
