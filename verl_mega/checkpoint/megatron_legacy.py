"""Megatron-LM's per-rank checkpoint layout.

    ROOT/latest_checkpointed_iteration.txt
    ROOT/iter_0000000/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   ({"model": state_dict, ...})

Layer numbers inside a pipeline stage's file are local to the stage; expert numbers local to the EP rank.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.serialization import config as serialization_config

TRACKER_NAME = "latest_checkpointed_iteration.txt"
FILE_NAME = "model_optim_rng.pt"

torch.serialization.add_safe_globals([argparse.Namespace])


def shard_path(root: str | Path, iteration: int, tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0,
               ep: int = 1) -> Path:
    name = f"mp_rank_{tp_rank:02d}"
    if pp > 1:
        name += f"_{pp_rank:03d}"
    if ep > 1:
        name += f"_{ep_rank:03d}"
    return Path(root) / f"iter_{iteration:07d}" / name / FILE_NAME


def write_shard(root: str | Path, iteration: int, coords: dict[str, int], state_dict: dict, args: dict) -> None:
    path = shard_path(root, iteration, **coords)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"model": state_dict, "checkpoint_version": 3.0, "iteration": iteration, "args": argparse.Namespace(**args)}
    # The zip records' CRC32 costs as much as the write itself; the files are renamed into place whole.
    with serialization_config.patch({"save.compute_crc32": False}):
        torch.save(payload, path)


def write_tracker(root: str | Path, iteration: int) -> None:
    (Path(root) / TRACKER_NAME).write_text(str(iteration))


def read_shard(root: str | Path, iteration: int, **coords) -> dict:
    """The shard's model state dict, memory-mapped so only the tensors touched are read."""
    path = shard_path(root, iteration, **coords)
    if not path.is_file():
        raise FileNotFoundError(f"shard file {path} is missing from the checkpoint at {root}")
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)["model"]
    except (RuntimeError, EOFError) as err:
        raise ValueError(f"shard file {path} is unreadable (truncated or corrupt): {err}") from None
