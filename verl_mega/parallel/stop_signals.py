"""Stop signals handed down the launch chain exactly once: launcher -> torchrun agent -> ranks.

A rank finishes its step, saves and exits on SIGTERM, SIGUSR1 or a first SIGINT (verl_mega.trainer.preemption);
the processes above it must neither die of the signal (their ranks would be killed with them) nor deliver it twice
(a second SIGINT stops a rank at once). So the launcher starts the agent in a session of its own, where a
terminal's Ctrl-C does not reach it, and passes each signal it receives to the agent; the agent passes it to its
ranks (each in a session of its own too) instead of torchrun's default: stop them, and kill them 30 s later.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Callable, Iterator

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def forwarding(targets: Callable[[], list[int]]) -> Iterator[list[int]]:
    """Within the block, each FORWARDED signal this process receives goes to the processes `targets()` names at
    that moment, instead of acting here; while there are none (the agent before it starts its ranks) the signal
    acts here as it would have. Yields the list of the signals passed on, as they come. Outside the main thread
    (where no handler can be set) it does nothing."""
    passed: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield passed
        return

    def forward(signum, frame) -> None:
        pids = targets()
        if pids:
            passed.append(signum)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if not pids:
            _act_as_before(signum, frame, previous[signum])

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    try:
        yield passed
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _act_as_before(signum: int, frame, handler) -> None:
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:  # the default action: restore it and take it
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def child_pids(parent: int | None = None) -> list[int]:
    """The pids of the live processes whose parent is `parent` (default: this process), read from /proc."""
    parent = os.getpid() if parent is None else parent
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, ...
        except (OSError, IndexError):  # ended meanwhile
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children
