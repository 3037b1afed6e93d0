"""Outputs appear whole or not at all: write into a temp sibling folder, rename at the end."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, overwrite: bool = False, flag: str = "--overwrite"):
    """Yield a temp folder beside `out`; on success it becomes `out`, on any error it is removed."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass {flag} to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
