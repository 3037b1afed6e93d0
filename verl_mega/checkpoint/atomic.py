"""Outputs appear whole or not at all: everything is written under a temp name beside the target and
renamed into place at the end. The one protocol for every file and folder the project writes.

- `atomic_write_text`: one file (scripts, configs, small state files);
- `atomic_output_dir`: a folder written by one process (conversions, exports);
- `collective_output_dir`: a folder written by every rank of a job (checkpoints, a role's final weights):
  rank 0 creates the temp folder, every rank writes into it, rank 0 publishes it once all are done.
Temp names start with "." and end in ".tmp" (plus a suffix when unique): readers skip them, and a kill
leaves at most such a temp beside the untouched previous output.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch.distributed as dist


def temp_name(out: Path) -> str:
    return f".{out.name}.tmp"


def publish_dir(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`, replacing an existing `out` (moved aside first, then removed)."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def atomic_write_text(path: str | Path, text: str, mode: int | None = None) -> Path:
    """Write `text` to `path` whole or not at all; `mode` sets the file's permission bits."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_name(path) + "-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, overwrite: bool = False, flag: str = "--overwrite"):
    """Yield a temp folder beside `out`; on success it becomes `out`, on any error it is removed."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass {flag} to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_name(out) + "-", dir=out.parent))
    try:
        yield tmp
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def collective_output_dir(out: str | Path, rank: int):
    """Collective: yield one temp folder (the same path on every rank) that rank 0 publishes as `out` after
    every rank has left the block. A failure on any rank leaves the temp folder behind, never `out` half
    written; the next save starts it afresh."""
    out = Path(out)
    tmp = out.with_name(temp_name(out))
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    yield tmp
    dist.barrier()
    if rank == 0:
        publish_dir(tmp, out)
    dist.barrier()
