"""The digests of a step checkpoint's files: recorded when the checkpoint is written, checked before it is read (at
resume and at export), so that flipped bytes, a truncated or a missing file is refused in one line naming the file
instead of being resumed from, or ending in a traceback.

    RUN/checkpoints/step_000012/digests.json   {"format": 1, "files": [{"path", "size", "sha256"}, ...]}

The record lists every other file of the checkpoint, trainer_state.json included, and trainer_state.json names the
record (`"digests": "digests.json"`): a record gone missing is told from a checkpoint written before records
existed, which is read unchecked. It is written inside the checkpoint's temp folder, so it appears together with
the completion marker when the folder is renamed into place.

Cost: each file is read once more after a save and before a resume or an export, the ranks of a job each hashing a
share of the files. `file_sha256` takes 0.22-0.33 CPU-s per 256 MiB (measured on the 2-core test machine), so a
100M-parameter fp32 model's checkpoint (weights, main copy and Adam moments: about 1.6 GB) costs 1.5-2 CPU-s per
pass, spread over the ranks; an export, one process, pays it alone.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch.distributed as dist

from verl_mega.files.digest import check_relative_path, file_entry, file_sha256, folder_files

from .folder import STATE_FILE

DIGESTS_FILE = "digests.json"
DIGESTS_KEY = "digests"  # trainer_state.json: the name of the checkpoint's record, where it has one
_FORMAT = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def record_digests(folder: Path, rank: int, world_size: int) -> None:
    """Collective, once every rank has written its files into `folder`: each rank hashes a share of them, rank 0
    writes the record."""
    dist.barrier()
    share = [file_entry(folder, path) for path in folder_files(folder)[rank::world_size]]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, share)
    if rank == 0:
        entries = sorted((entry for part in gathered for entry in part), key=lambda entry: entry["path"])
        (folder / DIGESTS_FILE).write_text(json.dumps({"format": _FORMAT, "files": entries}, indent=1))


def verify_digests(ckpt: Path, rank: int = 0, world_size: int = 1) -> None:
    """Raise ValueError, naming the file, where a file of checkpoint `ckpt` is missing, not listed, or not of the
    size and sha256 recorded; a checkpoint written before records existed passes. Collective when `world_size` > 1
    (each rank checks a share, every rank raises the same error)."""
    entries = _recorded_entries(ckpt)
    problem = None
    if entries is not None:
        known = {entry["path"] for entry in entries} | {DIGESTS_FILE}
        stray = [path for path in folder_files(ckpt) if path.relative_to(ckpt).as_posix() not in known]
        problem = f"{stray[0]} is not listed in {ckpt / DIGESTS_FILE}: it was not written by the save" if stray else None
        for entry in entries[rank::world_size]:
            problem = problem or _file_problem(ckpt / entry["path"], entry)
    if world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, problem)
        problem = next((found for found in gathered if found), None)
    if problem:
        raise ValueError(problem)


def verify_file_digest(ckpt: Path, name: str) -> None:
    """`verify_digests` for the one file `name` of checkpoint `ckpt` (what is read of a checkpoint before it is
    resumed from: its trainer_state.json, by the run folder's ownership check)."""
    entries = _recorded_entries(ckpt)
    if entries is None:
        return
    entry = next((entry for entry in entries if entry["path"] == name), None)
    problem = f"{ckpt / name} is not listed in {ckpt / DIGESTS_FILE}: it was not written by the save" \
        if entry is None else _file_problem(ckpt / name, entry)
    if problem:
        raise ValueError(problem)


def _file_problem(path: Path, entry: dict) -> str | None:
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{path} is {size} bytes, {entry['size']} when it was written (truncated or overwritten)"
    if file_sha256(path) != entry["sha256"]:
        return f"{path} does not match the sha256 recorded when it was written (its bytes changed)"
    return None


def _recorded_entries(ckpt: Path) -> list[dict] | None:
    """The checkpoint's record, checked; None for a checkpoint written before records existed."""
    record = ckpt / DIGESTS_FILE
    if not record.is_file():
        if _state_names_record(ckpt):
            raise ValueError(f"{record} is missing: the checkpoint recorded its files' digests there")
        return None
    try:
        data = json.loads(record.read_text())
        entries = data["files"] if isinstance(data, dict) and data.get("format") == _FORMAT else None
        if not isinstance(entries, list):
            raise ValueError(f"expected format {_FORMAT} and a list of files")
        for entry in entries:
            if not isinstance(entry, dict) or set(entry) != {"path", "size", "sha256"} \
                    or type(entry["size"]) is not int or not _SHA256.match(str(entry["sha256"])):
                raise ValueError(f"{entry!r} is not a path, size and sha256")
            check_relative_path(entry["path"])
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{record} is unreadable ({err})") from None
    return entries


def _state_names_record(ckpt: Path) -> bool:
    """Whether trainer_state.json names a record (an unreadable one is refused by its own reader)."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(state, dict) and state.get(DIGESTS_KEY) == DIGESTS_FILE
