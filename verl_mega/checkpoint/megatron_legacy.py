"""Megatron-LM's per-rank checkpoint layout.

    ROOT/latest_checkpointed_iteration.txt
    ROOT/iter_0000000/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   ({"model": state_dict, ...})

Layer numbers inside a pipeline stage's file are local to the stage; expert numbers local to the EP rank.
"""
from __future__ import annotations

import argparse
import pickle
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
    # Through a Python file so that a failed write (disk full, quota) raises OSError naming the file, where
    # torch's own file writer reports "unexpected pos".
    try:
        with serialization_config.patch({"save.compute_crc32": False}), open(path, "wb") as file:
            torch.save(payload, file)
    except (OSError, RuntimeError) as err:
        # torch's zip writer, closing after a failed write, raises its own error over the OSError.
        failure = err if isinstance(err, OSError) else err.__context__
        if not isinstance(failure, OSError):
            raise
        raise OSError(failure.errno, failure.strerror, str(path)) from None


def write_tracker(root: str | Path, iteration: int) -> None:
    (Path(root) / TRACKER_NAME).write_text(str(iteration))


def read_tracker(root: str | Path) -> int:
    path = Path(root) / TRACKER_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {root} is not a complete Megatron-LM checkpoint")
    text = path.read_text(errors="replace").strip()
    if not text.isdigit() or not text.isascii():
        raise ValueError(f"{path} must hold an iteration number, not {text[:40]!r}")
    return int(text)


def checked_iteration(root: str | Path, manifest_iteration: int, tp: int, pp: int, ep: int) -> int:
    """The tracker's iteration, once tracker, manifest and shard folders are found to agree."""
    iteration = read_tracker(root)
    if iteration != manifest_iteration:
        raise ValueError(f"{Path(root) / TRACKER_NAME} names iteration {iteration} but the manifest says "
                         f"{manifest_iteration}")
    check_shard_files(root, iteration, tp, pp, ep)
    return iteration


def check_shard_files(root: str | Path, iteration: int, tp: int, pp: int, ep: int) -> None:
    """Refuse an iteration folder that holds other shard folders than the (tp, pp, ep) layout's."""
    expected = {shard_path(root, iteration, t, p, pp, e, ep).parent.name
                for t in range(tp) for p in range(pp) for e in range(ep)}
    folder = Path(root) / f"iter_{iteration:07d}"
    found = {path.name for path in folder.iterdir()} if folder.is_dir() else set()
    if found != expected:
        missing, extra = sorted(expected - found), sorted(found - expected)
        detail = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise ValueError(f"{folder} does not hold the shards of tp={tp}, pp={pp}, ep={ep} ({detail}): the files "
                         "do not match the manifest's layout")


def read_shard(root: str | Path, iteration: int, **coords) -> dict:
    """The shard's model state dict, memory-mapped so only the tensors touched are read."""
    path = shard_path(root, iteration, **coords)
    if not path.is_file():
        raise FileNotFoundError(f"shard file {path} is missing from the checkpoint at {root}")
    try:
        payload = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as err:
        raise ValueError(f"shard file {path} is unreadable (truncated, corrupt or not weights-only): "
                         f"{str(err).splitlines()[0]}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("model"), dict) or not all(
            isinstance(name, str) and isinstance(tensor, torch.Tensor) for name, tensor in payload["model"].items()):
        raise ValueError(f"shard file {path} does not hold a Megatron-LM model state dict")
    return payload["model"]
