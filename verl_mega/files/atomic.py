"""Outputs appear whole or not at all: everything is written under a temp name beside the target and
renamed into place at the end. The one protocol for every file and folder the project writes.

- `atomic_write_text` / `atomic_write_bytes`: one file (scripts, configs, small state files, caches);
  `atomic_file` the same for a writer that takes a file name (profiler traces, plots);
- `atomic_output_dir`: a folder written by one process (conversions, exports);
- `collective_output_dir`: a folder written by every rank of a job (checkpoints, a role's final weights):
  rank 0 creates the temp folder, every rank writes into it, rank 0 publishes it once all are done.
Temp names start with "." and end in ".tmp" (plus a suffix when unique): readers skip them, and a kill
leaves at most such a temp beside the untouched previous output. Replacing an output is one atomic
`renameat2(RENAME_EXCHANGE)`, so a kill at any point leaves the previous output or the new one, never
nothing. Files and folders get the umask's mode (not mkstemp's / mkdtemp's 0600 / 0700): teammates read
shared outputs.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import socket
import tempfile
from pathlib import Path

import torch.distributed as dist

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def temp_name(out: Path) -> str:
    return f".{out.name}.tmp"


def publish_dir(tmp: Path, out: Path) -> None:
    """Move `tmp` to `out`, replacing an existing `out` (swapped atomically, then the old one removed)."""
    if out.exists():
        _exchange(tmp, out)  # tmp now holds the previous output
        shutil.rmtree(tmp)
    else:
        tmp.rename(out)


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: int | None = None):
    """A temp path beside `path` for a writer that takes a file name (a profiler's trace, a plot), renamed to
    `path` when the block ends without an error; `mode` sets the permission bits (default: the umask's)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_name(path) + "-", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str, mode: int | None = None) -> Path:
    """Write `text` to `path` whole or not at all; `mode` sets the file's permission bits (default: the umask's)."""
    with atomic_file(path, mode) as tmp:
        tmp.write_text(text)
    return Path(path)


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> Path:
    """Write `data` to `path` whole or not at all; `mode` as for `atomic_write_text`."""
    with atomic_file(path, mode) as tmp:
        tmp.write_bytes(data)
    return Path(path)


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, overwrite: bool = False, flag: str = "--overwrite", *,
                      sources: tuple[str | Path, ...] = ()):
    """Yield a temp folder beside `out`; on success it becomes `out`, on any error it is removed.

    `sources` are the inputs being read: an `out` equal to, inside or containing one is refused, so that
    replacing the output can never delete an input. Temp folders that killed writers on this host left
    beside `out` are removed first.
    """
    out = Path(out)
    for source in sources:
        _check_apart(out, Path(source))
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass {flag} to replace it")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder; remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out)
    tmp = out.with_name(f"{_owned_temp_prefix(out)}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
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


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _check_apart(out: Path, source: Path) -> None:
    out_real, source_real = out.resolve(), source.resolve()
    if out_real == source_real or source_real in out_real.parents or out_real in source_real.parents:
        raise ValueError(f"--out {out} overlaps the input {source} (the same folder, inside it, or containing "
                         "it): write the output somewhere else")


def _owned_temp_prefix(out: Path) -> str:
    """Temp folders of one writer process: host and pid tell whether their writer is gone."""
    return f"{temp_name(out)}-{socket.gethostname()}-"


def _remove_stale_temps(out: Path) -> None:
    prefix = _owned_temp_prefix(out)
    for path in out.parent.glob(f"{prefix}*"):
        pid = path.name[len(prefix):]
        if pid.isdigit() and not _is_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (Linux renameat2); where the filesystem cannot, fall back to three renames."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), str(b))
    aside = a.with_name(a.name + ".old")
    b.rename(aside)
    a.rename(b)
    aside.rename(a)
