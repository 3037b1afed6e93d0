"""Megatron-LM's per-rank checkpoint layout.

    ROOT/latest_checkpointed_iteration.txt
    ROOT/iter_0000000/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   ({"model": state_dict, ...})

Layer numbers inside a pipeline stage's file are local to the stage; expert numbers local to the EP rank.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Callable

import torch
from torch.utils.serialization import config as serialization_config

from verl_mega.config.errors import first_line

from .safetensors_io import pwrite_all

TRACKER_NAME = "latest_checkpointed_iteration.txt"
# Threads filling one shard file's records.
_FILL_THREADS = 2
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


def write_shard(root: str | Path, iteration: int, coords: dict[str, int], state_dict: dict, args: dict,
                streamed: dict[str, Callable[[int, int], None]] | None = None) -> None:
    """Writes one rank's file. With `streamed`, the tensors it names are placeholders (torch.empty, never
    touched) whose bytes `streamed[name](fd, offset)` writes into the open file at their place: the file is
    laid out first without any tensor bytes, then filled, so a converter can copy them from its sources
    without building the tensors. Every tensor must then own its storage (one record each, in order)."""
    path = shard_path(root, iteration, **coords)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"model": state_dict, "checkpoint_version": 3.0, "iteration": iteration, "args": argparse.Namespace(**args)}
    # The zip records' CRC32 costs as much as the write itself; the files are renamed into place whole.
    # Through a Python file so that a failed write (disk full, quota) raises OSError naming the file, where
    # torch's own file writer reports "unexpected pos".
    try:
        with serialization_config.patch({"save.compute_crc32": False}), open(path, "wb") as file, \
                (torch.serialization.skip_data() if streamed else contextlib.nullcontext()):
            torch.save(payload, file)
        if streamed:
            _fill_records(path, state_dict, streamed)
    except (OSError, RuntimeError) as err:
        # torch's zip writer, closing after a failed write, raises its own error over the OSError.
        failure = err if isinstance(err, OSError) else err.__context__
        if not isinstance(failure, OSError):
            raise
        raise OSError(failure.errno, failure.strerror, str(path)) from None


def _fill_records(path: Path, state_dict: dict, streamed: dict[str, Callable[[int, int], None]]) -> None:
    """Writes each tensor's bytes into the record torch.save left empty for it (skip_data): records are
    numbered in pickling order, which is the state dict's order."""
    with zipfile.ZipFile(path) as archive:
        records = sorted((info for info in archive.infolist() if "/data/" in info.filename and
                          info.filename.rsplit("/", 1)[1].isdigit()),
                         key=lambda info: int(info.filename.rsplit("/", 1)[1]))
    if len(records) != len(state_dict):
        raise RuntimeError(f"{path}: {len(records)} storage records for {len(state_dict)} tensors (shared storages?)")
    fd = os.open(path, os.O_RDWR)
    try:
        writes = []
        for info, (name, tensor) in zip(records, state_dict.items()):
            nbytes = tensor.numel() * tensor.element_size()
            if info.file_size != nbytes or tensor.untyped_storage().nbytes() != nbytes:
                raise RuntimeError(f"{path}: tensor '{name}' does not own its storage record ({info.filename})")
            # The record's data follows its local header: 30 bytes, the name and the extra field (alignment).
            name_length, extra_length = struct.unpack("<HH", os.pread(fd, 4, info.header_offset + 26))
            offset = info.header_offset + 30 + name_length + extra_length
            if name in streamed:
                writes.append(functools.partial(streamed[name], fd, offset))
            elif nbytes:
                data = tensor.contiguous().view(-1).view(torch.uint8).numpy()
                writes.append(functools.partial(pwrite_all, fd, data, offset))
        # Records are disjoint and every write is positioned, so they run side by side: one thread's copy
        # computes while another's waits on the disk.
        with concurrent.futures.ThreadPoolExecutor(_FILL_THREADS) as pool:
            for write in [pool.submit(write) for write in writes]:
                write.result()
    finally:
        os.close(fd)


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
    except (RuntimeError, EOFError, pickle.UnpicklingError, OSError) as err:  # a truncated zip under mmap: EINVAL
        raise ValueError(f"shard file {path} is unreadable (truncated, corrupt or not weights-only): "
                         f"{first_line(err)}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("model"), dict) or not all(
            isinstance(name, str) and isinstance(tensor, torch.Tensor) for name, tensor in payload["model"].items()):
        raise ValueError(f"shard file {path} does not hold a Megatron-LM model state dict")
    return payload["model"]
