"""Who may write a run folder: one live run at a time (a lock), and only a run of the model it was started with.

Rank 0 holds an exclusive `flock` on `RUN/.lock` for the whole run and records its host and pid in it, so a
second run on the same folder is refused naming the holder. The kernel drops the lock when the process dies,
however it dies (processes it forks let go of it at once), so a killed run never leaves a stale lock. Both
checks run before anything is written into the folder.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist

from verl_mega.checkpoint.manifest import Manifest
from verl_mega.config.errors import UserError

from . import checkpoints
from .checkpoint_digests import verify_file_digest
from .folder import RunFolder


class RunFolderLock:
    """An exclusive lock on a run folder, held until `release()` or the end of the process."""

    def __init__(self, run_dir: Path):
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(RunFolder(run_dir).lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise UserError(f"trainer.run_dir {run_dir} cannot be used as a run folder ({err.strerror}: "
                            f"{err.filename})") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(self._fd)
            os.close(self._fd)
            raise UserError(f"run folder {run_dir} is in use by another run ({holder}); wait for it to end, or "
                            "point trainer.run_dir elsewhere") from None
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode(), 0)
        # A forked helper (megatron's checkpoint writers fork) shares the lock; one that outlived this process
        # would keep the folder locked, so children drop their copy at once (closing, not unlocking).
        os.register_at_fork(after_in_child=self._close_in_child)

    def _close_in_child(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        return f"host {record['host']}, pid {record['pid']}, since {record['since']}"
    except (ValueError, KeyError, TypeError):  # the holder is between truncating and writing its record
        return "host and pid not recorded yet"


_ANOTHER_MODEL = "; point trainer.run_dir elsewhere, or model.hf_path at that run's model"


def ownership_problem(run_dir: Path, fingerprint: str, family_spec: str | None = None) -> str | None:
    """Why `run_dir` belongs to another model than the one with `fingerprint`, or None if it does not
    (`family_spec`: model.family_spec, read in place of the one the initial checkpoints record)."""
    for initial in RunFolder(run_dir).initial_conversions("actor"):
        try:
            hf_config = Manifest.read(initial, family_spec).hf_config
        except (OSError, ValueError) as err:
            return f"{initial} is unreadable ({err}); remove it to convert the model again"
        if checkpoints.model_fingerprint(hf_config) != fingerprint:
            return f"{run_dir} was written for another model ({initial.name} differs){_ANOTHER_MODEL}"
    found = checkpoints.complete_checkpoints(run_dir)
    if found:
        state_file = found[-1] / checkpoints.STATE_FILE
        try:  # its bytes first: a flipped byte of the fingerprint is damage, not another model
            verify_file_digest(found[-1], checkpoints.STATE_FILE)
        except ValueError as err:
            return f"{err}; remove {found[-1]} to resume from an earlier checkpoint"
        try:
            written_for = json.loads(state_file.read_text()).get("model_fingerprint")
        except (OSError, ValueError, AttributeError):
            return f"{state_file} is unreadable; remove {found[-1]} to resume from an earlier checkpoint"
        if written_for != fingerprint:
            return f"{run_dir} was written for another model (checkpoint {found[-1].name} differs){_ANOTHER_MODEL}"
    return None


def claim_run_folder(run_dir: Path, fingerprint: str, rank: int,
                     family_spec: str | None = None) -> RunFolderLock | None:
    """Collective: rank 0 locks the folder and checks whose it is; every rank raises the same UserError
    if the run may not use it. Returns rank 0's lock (None elsewhere)."""
    lock, problem = None, None
    if rank == 0:
        try:
            lock = RunFolderLock(run_dir)
            problem = ownership_problem(run_dir, fingerprint, family_spec)
        except UserError as err:
            problem = str(err)
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        if lock is not None:
            lock.release()
        raise UserError(verdict[0])
    return lock
