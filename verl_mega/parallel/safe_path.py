"""The working folder is on the import path of no Python process the project starts.

`python -m M` and `python script.py` put the working folder (or the script's) first on `sys.path`, so a file
there named like a module the process imports (`signal.py`, `json.py`, `torch.py`) runs in its place: a planted
file runs inside the trainer unnoticed, a user's own `signal.py` crashes the run. Python 3.11's PYTHONSAFEPATH=1
leaves that folder out; the project sets it for the reward worker, the torchrun agent and its ranks (and so for
whatever those start: vLLM's workers, a reward function's own subprocesses). The sandbox runs isolated (`-I`); the reward worker
then takes its parent's `sys.path`, so it imports what the trainer imports.
A user module (`reward.function: "module:function"`, a tool, `--module`) is found through the user's own
PYTHONPATH, which stays on the path; Python 3.10 ignores the variable.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SAFE_PATH_ENV = {"PYTHONSAFEPATH": "1"}


@contextmanager
def without_working_folder() -> Iterator[None]:
    """In this process, what PYTHONSAFEPATH=1 does for a new one: the working folder, which `python -m` put first on
    `sys.path`, is off it until the block ends (for a rank run in its launcher's process)."""
    entry = sys.path[0] if sys.path and not sys.flags.safe_path else None
    if entry is None or os.path.abspath(entry) != os.getcwd():
        yield
        return
    del sys.path[0]
    try:
        yield
    finally:
        sys.path.insert(0, entry)
