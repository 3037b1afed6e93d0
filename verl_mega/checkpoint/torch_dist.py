"""Reading megatron `dist_checkpointing` ("torch_dist") model checkpoints.

    CKPT/iter_0000000/metadata.json, .metadata, __*_*.distcp

Each stored key is one full (TP-merged) tensor stacked over layers (and experts), so a checkpoint written at
one layout loads into a model at any other, and reads back to HF key by key without building a model.
(Writing one needs megatron's own model at the target layout: `verl_mega.converters.torch_dist`.)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch

from verl_mega.models import HFModelConfig, family_for
from verl_mega.models.sharding import rank_slots, split_mcore_to_hf, strip_vocab_padding
from verl_mega.parallel.launch import free_port

from .manifest import Manifest

DIST_DIR = "iter_0000000"


def load_torch_dist(model, ckpt_dir: str | Path) -> None:
    """Load a dist checkpoint into this rank's model, whatever layout it was saved at."""
    from megatron.core import dist_checkpointing

    path = Path(ckpt_dir) / DIST_DIR
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete dist checkpoint (metadata.json missing)")
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(path))
    model.load_state_dict(loaded, strict=False)


def iter_torch_dist_hf_tensors(ckpt_dir: str | Path, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every tensor, loading one stacked dist-checkpoint key at a time."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    _ensure_single_process_group()
    path = str(Path(ckpt_dir) / DIST_DIR)
    metadata = dist_checkpointing.load_tensors_metadata(path)
    cfg = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(cfg)
    current_key, stacked = None, None
    for slot in rank_slots(cfg, family):
        key, index = _dist_key(slot, metadata)
        if key != current_key:
            meta = metadata[key]
            request = {key: ShardedTensor.from_rank_offsets(key, torch.empty(meta.global_shape, dtype=meta.dtype))}
            current_key, stacked = key, dist_checkpointing.load(request, path)[key]
        tensor = stacked[index] if index else stacked
        for name, hf_tensor in split_mcore_to_hf(slot, cfg, [tensor]):
            yield name, strip_vocab_padding(slot.rule, hf_tensor, cfg.vocab_size)


def _dist_key(slot, metadata) -> tuple[str, tuple[int, ...]]:
    """The stored key of a slot and its index in the layer (and expert) axes."""
    rule_name = slot.rule.mcore
    key = rule_name.replace(".{layer}", "").replace("local_experts.{expert}", "experts")
    index = tuple(i for i in (slot.layer, slot.expert) if i is not None)
    # megatron's local spec saves an MoE layer's pre-MLP norm under the dense TE name.
    candidates = [key, key.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")]
    for candidate in candidates:
        if candidate in metadata:
            return candidate, index
    raise ValueError(f"dist checkpoint lacks '{key}' (for {slot.global_name}); it was written for another model")


def _ensure_single_process_group() -> None:
    """megatron's loader needs a process group; a plain export process gets a world of one."""
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
