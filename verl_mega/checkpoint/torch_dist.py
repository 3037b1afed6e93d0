"""Reading megatron `dist_checkpointing` ("torch_dist") checkpoints: converted models and roles' training states.

    CKPT/iter_0000000/metadata.json, .metadata, __*_*.distcp

Each stored key is one full (TP-merged) tensor stacked over layers (and experts), so a checkpoint written at
one layout loads into a model at any other, and reads back to HF key by key without building a model.
(Writing one needs megatron's own model at the target layout: `verl_mega.converters.torch_dist`.)
"""
from __future__ import annotations

import contextlib
import json
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
from torch.distributed.checkpoint import CheckpointException

from verl_mega.config.errors import first_line
from verl_mega.models import HFModelConfig, family_for
from verl_mega.models.expected_shapes import mcore_shape
from verl_mega.models.sharding import rank_slots, split_mcore_to_hf, strip_vocab_padding
from verl_mega.models.spec import local_spellings
from verl_mega.parallel.world import single_process_world

from .manifest import Manifest
from .roles import head_rules
from .safe_unpickle import guard_dist_checkpoint_reads

DIST_DIR = "iter_0000000"


def load_torch_dist(model, ckpt_dir: str | Path) -> None:
    """Load a dist checkpoint into this rank's model, whatever layout it was saved at."""
    from megatron.core import dist_checkpointing

    guard_dist_checkpoint_reads()
    path = Path(ckpt_dir) / DIST_DIR
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete dist checkpoint (metadata.json missing)")
    with _unreadable_is_refused(path):
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(path))
    model.load_state_dict(loaded, strict=False)


def iter_torch_dist_hf_tensors(dist_dir: str | Path, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every tensor of a dist checkpoint folder (a converted checkpoint's
    iter_0000000, or a role's training state), loading one stacked key at a time; optimizer state is skipped."""
    guard_dist_checkpoint_reads()
    with _process_group():
        yield from _stacked_hf_tensors(str(dist_dir), manifest)


def _stacked_hf_tensors(path: str, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    from megatron.core import dist_checkpointing

    if not (Path(path) / "metadata.json").is_file() or not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete dist checkpoint (metadata.json or .metadata missing)")
    with _unreadable_is_refused(path):
        metadata = dist_checkpointing.load_tensors_metadata(path)
    hf_config = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(hf_config, manifest.family_spec, Path(path).parent, recorded=True)  # never a spec from the checkpoint
    current_key, stacked = None, None
    for slot in rank_slots(hf_config, family, head_rules=head_rules(manifest.role)):
        key, index = _dist_key(slot, metadata)
        if key != current_key:
            current_key, stacked = key, _load_whole(key, metadata[key], path)
        tensor = _entry(stacked, index, key, slot.global_name, path)
        _check_dist_tensor(slot, hf_config, tensor, path)
        for name, hf_tensor in split_mcore_to_hf(slot, hf_config, [tensor]):
            yield name, strip_vocab_padding(slot.rule, hf_tensor, hf_config.vocab_size)


def read_adapter_tensors(dist_dir: str | Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    """'<global megatron module>.lora_a' / '.lora_b' -> the TP-merged adapter, for every linear of the manifest's
    model that a LoRA role's training state (`run.training_state`) holds adapters of; the base is not read."""
    from megatron.core import dist_checkpointing

    guard_dist_checkpoint_reads()
    path = str(dist_dir)
    if not (Path(path) / "metadata.json").is_file() or not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete dist checkpoint (metadata.json or .metadata missing)")
    hf_config = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(hf_config, manifest.family_spec, Path(path).parent, recorded=True)
    adapters, stacks = {}, {}
    with _process_group():
        with _unreadable_is_refused(path):
            metadata = dist_checkpointing.load_tensors_metadata(path)
        for slot in rank_slots(hf_config, family, head_rules=head_rules(manifest.role)):
            if not slot.rule.mcore.endswith(".weight"):
                continue
            for kind in ("lora_a", "lora_b"):
                adapter = replace(slot, rule=replace(slot.rule, mcore=slot.rule.mcore.removesuffix("weight") + kind))
                try:
                    key, index = _dist_key(adapter, metadata)
                except ValueError:
                    continue  # a linear without adapters (or not a linear)
                if key not in stacks:
                    stacks[key] = _load_whole(key, metadata[key], path)
                adapters[adapter.global_name] = _entry(stacks[key], index, key, adapter.global_name, path)
    return adapters


def _load_whole(key: str, meta, path: str) -> torch.Tensor:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    request = {key: ShardedTensor.from_rank_offsets(key, torch.empty(meta.global_shape, dtype=meta.dtype))}
    with _unreadable_is_refused(path):
        return dist_checkpointing.load(request, path)[key]


@contextlib.contextmanager
def _unreadable_is_refused(path):
    """A truncated, missing or garbled file of the dist checkpoint at `path` (megatron's and torch's readers raise
    a bare EOFError, FileNotFoundError or JSON error naming no checkpoint) is a ValueError naming the folder."""
    try:
        yield
    except (EOFError, OSError, RuntimeError, pickle.UnpicklingError, json.JSONDecodeError, CheckpointException) as err:
        if isinstance(err, CheckpointException):  # torch's reader wraps each rank's error: name the first
            err = next(iter(err.failures.values()))[0]
        raise ValueError(f"dist checkpoint {path} is unreadable (a file truncated, missing or corrupt): "
                         f"{first_line(err)}") from None


def _entry(stored: torch.Tensor, index: tuple[int, ...], key: str, name: str, path: str) -> torch.Tensor:
    """The layer (and expert) entry `index` of a stored tensor (all of it for no index); ValueError naming the
    tensor where it has no such entry (fewer layers or dimensions than the manifest's model), not IndexError."""
    if not index:
        return stored
    if stored.dim() <= len(index) or any(i >= size for i, size in zip(index, stored.shape)):
        raise ValueError(f"tensor '{key}' in {path} is {list(stored.shape)}: it has no entry {list(index)} for "
                         f"{name}; it was written for another model than the manifest's")
    return stored[index]


def _check_dist_tensor(slot, hf_config, tensor: torch.Tensor, path: str) -> None:
    """The stored tensor has the shape the manifest's config implies (vocabulary rows: padded at save time)."""
    expected, found = mcore_shape(slot.rule, hf_config), tuple(tensor.shape)
    fits = (found[1:] == expected[1:] and found[0] >= expected[0]) if slot.rule.vocab else found == expected
    if not fits or not tensor.is_floating_point():
        raise ValueError(f"tensor '{slot.global_name}' in {path} is {tensor.dtype} {list(found)}, the manifest's "
                         f"hf_config implies a floating-point {list(expected)}")


def _dist_key(slot, metadata) -> tuple[str, tuple[int, ...]]:
    """The stored key of a slot and its index in the layer (and expert) axes: layers stacked on one axis, or keyed
    apart (megatron does so when dense and MoE layers mix)."""
    rule_name = slot.rule.mcore.replace("local_experts.{expert}", "experts")
    stacked = rule_name.replace(".{layer}", "")
    layouts = [(stacked, tuple(i for i in (slot.layer, slot.expert) if i is not None))]
    if slot.layer is not None:
        layouts.append((rule_name.replace("{layer}", str(slot.layer)), () if slot.expert is None else (slot.expert,)))
    for key, index in layouts:
        # megatron's local spec saves an MoE layer's pre-MLP norm under the dense TE name, and its MLA layers'
        # norms under their local names.
        for candidate in (key, key.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                          *local_spellings(key)):
            if candidate in metadata:
                return candidate, index
    raise ValueError(f"dist checkpoint lacks '{stacked}' (for {slot.global_name}); it was written for another model")


@contextlib.contextmanager
def _process_group():
    """megatron's loader needs a process group: a plain export process gets a world of one for the read, and
    gives it back after, so the caller's process is left as it was."""
    if torch.distributed.is_initialized():
        yield
        return
    world = single_process_world()
    torch.distributed.init_process_group("gloo", init_method=world.init_method, rank=world.rank, world_size=world.size)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
