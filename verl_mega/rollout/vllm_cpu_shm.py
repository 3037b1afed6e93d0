"""The shared-memory segments of vLLM's CPU engine at rollout TP > 1: leaked ones cleared, live ones named.

vLLM's CPU build all-reduces a TP group through POSIX shared memory, one `/dev/shm` segment per rank, named
`{ident}-tp:0-[{group ranks}]-cpushm_{rank}`. Under the external launcher `ident` is empty (vLLM derives it
from the init method, `env://`), so every such engine on a machine names its segments alike, and creating one
that exists fails with `create shm in SHMManager failed. errno: 17`. vLLM removes them in its native teardown,
which a rank killed by SIGKILL, the OOM killer or its torchrun agent never reaches: one killed run stops every
later vLLM job on the machine until someone deletes them by hand (measured: a killed test run left two, and the
next CI run on the machine failed all six vLLM TP 2 tests).

Before its engine starts, each rollout rank clears the segments its group will create if no process maps them
(mapped is the only sign a segment is in use: a live engine maps its own and its peers' the moment it creates
them), and refuses in one line naming the process if one does. Only names of that exact shape are touched.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

SHM_DIR = Path("/dev/shm")
PROC_DIR = Path("/proc")


def segment_names(group_ranks: Sequence[int]) -> list[str]:
    """The segments vLLM's CPU engine creates for a TP group of these global ranks under the external launcher."""
    ranks = "-".join(str(rank) for rank in group_ranks)
    return [f"-tp:0-[{ranks}]-cpushm_{local}" for local in range(len(group_ranks))]


def mapping_processes(path: Path, proc_dir: Path = PROC_DIR) -> list[int]:
    """The ids of the processes whose memory maps `path`, of those whose maps this user may read: a process of
    another user is not seen, but its segments are not this user's to remove either (`/dev/shm` is sticky)."""
    holders = []
    pattern = re.compile(rf" {re.escape(str(path))}(?: \(deleted\))?$")
    for maps in proc_dir.glob("[0-9]*/maps"):
        try:
            lines = maps.read_text(errors="replace").splitlines()
        except OSError:  # the process ended while we looked, or is not ours to read
            continue
        if any(pattern.search(line) for line in lines):
            holders.append(int(maps.parent.name))
    return holders


def clear_leaked_segments(group_ranks: Sequence[int], shm_dir: Path = SHM_DIR, proc_dir: Path = PROC_DIR) -> list[Path]:
    """Remove the segments this TP group will create that a killed run left behind; return what was removed.
    Raise if a live process maps one: its engine and this one would share memory."""
    removed = []
    for name in segment_names(group_ranks):
        path = shm_dir / name
        if not path.exists():
            continue
        holders = mapping_processes(path, proc_dir)
        if holders:
            raise RuntimeError(
                f"{path} is in use by process {holders[0]}: vLLM's CPU engine names its TP shared memory the same "
                "in every job on a machine, so run one vLLM job at rollout_tp > 1 per machine at a time")
        try:
            path.unlink(missing_ok=True)
        except PermissionError:
            raise RuntimeError(f"{path} belongs to another user, whose vLLM job at rollout_tp > 1 may be running: "
                               "vLLM's CPU engine names its TP shared memory the same in every job on a machine, so "
                               "run this job on another machine or after theirs") from None
        removed.append(path)
    return removed
