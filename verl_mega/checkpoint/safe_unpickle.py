"""Reading a dist checkpoint (torch_dist) runs no code from it.

torch's `FileSystemReader` unpickles a checkpoint's `.metadata` with plain `pickle`, its default load planner
reads non-tensor items with `torch.load(weights_only=False)`, and megatron reads `common.pt` with torch.load's
default (weights-only unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set): a planted file in a checkpoint or run folder
would run a command on load. `guard_dist_checkpoint_reads` routes all three through safe readers, for torch's and
megatron's loaders alike (megatron's readers and planners subclass these): `.metadata` through an unpickler that
admits only the classes checkpoint metadata is made of, byte items and `common.pt` through torch's weights-only
loader, asked for explicitly. A refusal is one line naming the file and the object refused, never torch's advice
to retry with the protection off.
"""
from __future__ import annotations

import functools
import importlib
import pickle
from pathlib import Path

import torch

from verl_mega.config.errors import first_line
from verl_mega.parallel import megatron_versions

# Modules whose own classes (dataclasses and enums, no behaviour on construction) make up the metadata.
_CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_SINGLE_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a name -> torch.layout lookup
    ("torch", "Size"),
    ("collections", "OrderedDict"),
}


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals dist-checkpoint metadata needs; anything else is refused."""

    def find_class(self, module: str, name: str):
        found = super().find_class(module, name) if _is_allowed(module, name) else None
        if found is None:
            raise pickle.UnpicklingError(f"refusing to load '{module}.{name}': not part of checkpoint metadata")
        return found


def _is_allowed(module: str, name: str) -> bool:
    if (module, name) in _SINGLE_GLOBALS:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module in _CLASS_MODULES and not name.startswith("__"):
        value = getattr(importlib.import_module(module), name, None)
        return isinstance(value, type) and value.__module__ == module
    return False


def read_dist_metadata(path: str | Path):
    """Unpickle a `.metadata` file with `MetadataUnpickler`; a refused or corrupt file is a ValueError naming it."""
    try:
        with open(path, "rb") as file:
            return MetadataUnpickler(file).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as err:
        raise ValueError(f"{path} is not valid dist-checkpoint metadata: {err}") from None


@functools.cache
def guard_dist_checkpoint_reads() -> None:
    """Install the safe readers into torch's dist-checkpoint reader and load planner (once per process)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    def read_metadata(self, *args, **kwargs):
        # torch's own body, with the unpickler replaced.
        metadata = read_dist_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def load_bytes(self, read_item, value) -> None:
        loaded = load_weights_only(value, f"the dist checkpoint's item {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    FileSystemReader.read_metadata = read_metadata
    DefaultLoadPlanner.load_bytes = load_bytes
    _guard_common_state_reads()


def _guard_common_state_reads() -> None:
    """megatron's `common.pt` read weights-only whatever the environment says, by the reader its release has
    (parallel/megatron_versions.py). 0.19 writes the common state into the dist checkpoint itself, read through
    the byte-item guard above, and reads common.pt only in checkpoints written before it."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common

    def read_common(checkpoint_dir, megatrons_read):
        path = Path(checkpoint_dir) / common.COMMON_STATE_FNAME
        if not path.is_file():  # megatron's own error for a missing file
            return megatrons_read(checkpoint_dir)
        return load_weights_only(path, str(path))

    if megatron_versions.since("common_state_reader_is_a_function"):
        megatrons_function = common.load_common
        common.load_common = serialization.load_common = functools.partial(read_common,
                                                                           megatrons_read=megatrons_function)
    else:
        megatrons_method = common.TorchCommonLoadStrategy.load_common
        common.TorchCommonLoadStrategy.load_common = (
            lambda self, checkpoint_dir: read_common(checkpoint_dir, functools.partial(megatrons_method, self)))


def load_weights_only(source, what: str):
    """torch.load(source, weights_only=True) on the CPU; a refused or corrupt payload is a ValueError naming `what`
    and the object refused, without torch's advice to load it unsafely."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except EOFError:
        raise ValueError(f"{what} is empty or truncated: convert the model again") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        refused = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line), None)
        detail = refused or first_line(err)
        raise ValueError(f"{what} holds objects a checkpoint is not made of, refused unread ({detail}): it was not "
                         "written by verl_mega or megatron-core; convert the model again") from None
