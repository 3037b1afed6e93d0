"""Ending a rank's process once its work is done, without freeing the interpreter's objects one by one.

When a rank's entry point returns (`verl_mega.trainer.main`, the parity check, a test worker), the job has written
what a user relies on and destroyed its process groups. What a normal exit still does is CPython's finalization:
freeing, object by object, what the ~3,500 modules of torch, transformers and megatron-core hold (about 1.4 CPU-s
per rank process, CPU, tiny GRPO run), and then the C library's `exit`: C atexit handlers and C++ static
destructors.

`exit_process` keeps everything of a normal exit that anyone outside the process can observe and skips only the
freeing. It waits for non-daemon threads, runs Python's atexit handlers (logging's flush, multiprocessing's clean-up
of child processes, wandb's), flushes every Python file still open (a buffered write a reward function or a logger
never closed reaches its file, as the objects' finalizers would have done it), and then calls the C library's
`exit`. That last step is why this is not `os._exit`: native libraries free what outlives a process in their
static destructors. vLLM's CPU engine at rollout TP > 1 removes its `/dev/shm/*cpushm*` all-reduce segments only
there, and a leaked segment makes every later engine on the machine fail to create its own
(`create shm in SHMManager failed. errno: 17`): `tests/test_vllm_rollout.py` checks that a run leaves none.
A library whose resources are released by its Python objects' finalizers asks for the whole normal exit with
`keep_finalizers_at_exit` (vLLM's engine does, as it starts), so this module names no library.
"""
from __future__ import annotations

import _io
import atexit
import ctypes
import gc
import sys
import threading
from typing import NoReturn

# Why this process's objects must be finalized at exit, one entry per `keep_finalizers_at_exit` call.
_FINALIZERS_NEEDED: list[str] = []


def keep_finalizers_at_exit(reason: str) -> None:
    """Make `exit_process` in this process exactly `sys.exit`, for a library whose resources are released by its
    Python objects' finalizers (`reason` says which, and why)."""
    _FINALIZERS_NEEDED.append(reason)


def exit_process(code: int | None) -> NoReturn:
    """Exit with `code` as `sys.exit(code)` would (None is 0), minus freeing the interpreter's objects; under a
    profiler, debugger or coverage tool, or after `keep_finalizers_at_exit`, exactly `sys.exit(code)`."""
    # `python -m cProfile -o F -m verl_mega.trainer.main` writes F after the module returns.
    if observed() or _FINALIZERS_NEEDED:
        sys.exit(code)
    code = 0 if code is None else code
    if type(code) is not int:  # sys.exit prints any other object and exits 1
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # CPython's own handlers, which the C exit below does not run
    flush_open_files()
    # PyDLL keeps the GIL through the call: native destructors that touch Python objects find the interpreter
    # whole, and no Python thread runs while they do.
    ctypes.PyDLL(None).exit(code)
    raise AssertionError("the C library's exit returned")


def observed() -> bool:
    """Whether a tool watches this interpreter (a trace or profile hook, or a sys.monitoring tool on 3.12+) and
    may still have work to do after the program returns."""
    monitoring = getattr(sys, "monitoring", None)
    tools = monitoring is not None and any(monitoring.get_tool(tool) for tool in range(6))
    return sys.gettrace() is not None or sys.getprofile() is not None or tools


def flush_open_files() -> None:
    """Flush every open Python file object (text and buffered), stdout and stderr last (~0.07 CPU-s over the
    ~480,000 objects of a trainer's rank)."""
    for obj in gc.get_objects():
        # Every io class derives from the C base `_io._IOBase`. The class is read with type(): isinstance would
        # ask each object for its __class__, which lazy proxies (torch's deprecated module attributes) answer
        # with warnings and imports.
        if issubclass(type(obj), _io._IOBase) and obj is not sys.stdout and obj is not sys.stderr:
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):  # a pipe whose reader left, a file detached: as a finalizer would, ignore
                pass
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
