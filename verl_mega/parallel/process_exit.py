"""Ending a rank's process once its work is done, without the interpreter's teardown.

When `verl_mega.trainer.main` returns, the job has written and closed everything a user relies on (step
checkpoints, final weights, metrics and TensorBoard files, the mirror's uploads: `TrainingJob.fit`), and the
process group is destroyed. What a normal exit still does after that is CPython's finalization: freeing, one by
one, the objects of the ~3,500 modules torch, transformers and megatron-core load, and torch's C++ teardown:
about 1.5-2 CPU-s per rank process (tiny GRPO run, CPU), several seconds of wall time on a shared machine.

`exit_process` keeps every part of a normal exit that anyone can observe: it waits for non-daemon threads, runs
the atexit handlers (logging's flush, multiprocessing's clean-up of child processes, wandb's, coverage's) and
flushes stdout and stderr; then it ends the process with `os._exit`, leaving the memory to the kernel.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """Exit with `code` as `sys.exit(code)` would, minus freeing the interpreter's objects one by one."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # CPython's own handlers, which os._exit alone would skip
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
