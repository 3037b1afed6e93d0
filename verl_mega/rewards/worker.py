"""The scoring worker: a warm child process that runs a named reward function on answers, each under a hard
time limit.

Threat model: the policy's answers are untrusted input to a parser. A string such as `\\boxed{9^{9^{9}}}` makes
sympy (through math-verify) compute for hours or allocate without bound, and inside C code signal.alarm cannot
interrupt it (alarm also works only in the main thread). So the answers go to a child process, one request
per batch, and the parent waits at most `timeout_s` for each answer's verdict: a late answer scores 0, the
child is killed and a fresh one takes the rest of the batch. The child's heap is capped (RLIMIT_DATA), so a
blow-up ends there with MemoryError instead of taking the node's memory, and it dies with its parent
(PR_SET_PDEATHSIG) if the trainer is killed. The reward function itself is the user's code and trusted.

Wire: a socket pair; requests are pickled rows from the parent, verdicts come back as JSON (`results`).
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import resource
import signal
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection, Pipe

from verl_mega.config.schema import RewardCodeConfig, RewardMathConfig
from verl_mega.parallel.safe_path import SAFE_PATH_ENV

from . import code_tests, math_answers

from .registry import get_reward_fn
from .results import Died, Stopped, Verdict, call_reward, from_wire, to_wire

STARTUP_TIMEOUT_S = 120.0  # importing the function (sympy, math-verify: ~1 s) on a loaded node
READY = b"ready"
PR_SET_PDEATHSIG = 1


class ScoringWorker:
    """Scores rows `(data_source, solution_str, ground_truth, extra_info)` with the function named `function`
    in a child process; `timeout_s` per answer, `memory_limit_mb` for the child's heap (0: no cap), `code` the
    limits of the code tests it runs (reward.code), `math` the math-verify rewards' options (reward.math)."""

    def __init__(self, function: str, timeout_s: float, memory_limit_mb: int,
                 code: RewardCodeConfig = RewardCodeConfig(), math: RewardMathConfig = RewardMathConfig()):
        self.function, self.timeout_s, self.memory_limit_mb = function, timeout_s, memory_limit_mb
        self.code, self.math = code, math
        self.process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._finalizer = None

    def score(self, rows: list[tuple]) -> list[Verdict]:
        """One verdict per row, in order; the rows a limit stopped are `Stopped`, those it died on `Died`."""
        verdicts: list[Verdict] = []
        while len(verdicts) < len(rows):
            self._start()
            pending = rows[len(verdicts):]
            self._conn.send(pending)
            verdicts += self._collect(len(pending))
        return verdicts

    def _collect(self, count: int) -> list[Verdict]:
        """Up to `count` verdicts as they come, ending early (the child killed) at the first stopped answer or
        the child's death."""
        verdicts = []
        for _ in range(count):
            verdicts.append(self._next_verdict())
            if isinstance(verdicts[-1], (Stopped, Died)):
                self.close()
                break
        return verdicts

    def _next_verdict(self) -> Verdict:
        if not self._conn.poll(self.timeout_s):
            return Stopped(f"took longer than reward.timeout_s={self.timeout_s:g} s")
        try:
            return from_wire(self._conn.recv_bytes())
        except EOFError:
            return Died(f"the scoring worker died on it (exit code {self.process.wait()})")

    def _start(self) -> None:
        """A running child that has imported the function (the time limit counts from here)."""
        if self.process is not None:
            return
        parent, child = Pipe()
        command = [sys.executable, "-m", "verl_mega.rewards.worker", str(child.fileno()), str(os.getpid())]
        self.process = subprocess.Popen(command, pass_fds=(child.fileno(),), env={**os.environ, **SAFE_PATH_ENV})
        child.close()
        self._conn = parent
        self._finalizer = weakref.finalize(self, _kill, self.process, parent)  # at exit too
        parent.send({"sys_path": sys.path, "function": self.function, "memory_limit_mb": self.memory_limit_mb,
                     "code": dataclasses.asdict(self.code), "math": dataclasses.asdict(self.math)})
        if not (parent.poll(STARTUP_TIMEOUT_S) and _received(parent) == READY):
            code = self.process.poll()
            self.close()
            raise RuntimeError(f"the scoring worker for reward.function {self.function!r} did not start "
                               f"(exit code {code}; its error, if any, is printed above)")

    def close(self) -> None:
        """Kill the child (it holds no state worth keeping); a later `score` starts a fresh one."""
        if self._finalizer is not None:
            self._finalizer()
        self.process = self._conn = self._finalizer = None


def _received(conn: Connection) -> bytes | None:
    try:
        return conn.recv_bytes()
    except EOFError:
        return None


def _kill(process: subprocess.Popen, conn: Connection) -> None:
    process.kill()
    process.wait()
    conn.close()


# --- the child ---------------------------------------------------------------------------------------------

def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent exits (Linux); elsewhere the child ends at the closed socket's EOF, once idle."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):
        return
    if os.getppid() != parent_pid:  # the parent was gone before the request took effect
        os._exit(1)


def _cap_heap(memory_limit_mb: int) -> None:
    if memory_limit_mb > 0:
        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def serve(conn: Connection) -> None:
    """Read the set-up, then score each request's rows, one verdict message per row, until the parent leaves."""
    setup = conn.recv()
    sys.path[:] = setup["sys_path"]  # the parent's, so "module:function" imports the same module
    _cap_heap(setup["memory_limit_mb"])
    code_tests.configure(RewardCodeConfig(**setup["code"]))
    math_answers.configure(RewardMathConfig(**setup["math"]))
    fn = get_reward_fn(setup["function"])
    conn.send_bytes(READY)
    while True:
        try:
            rows = conn.recv()
        except EOFError:
            return
        for row in rows:
            try:
                verdict = call_reward(fn, row)
            except MemoryError:  # the heap may be in pieces: report, and leave the rest to a fresh child
                conn.send_bytes(to_wire(Stopped(f"exceeded reward.memory_limit_mb={setup['memory_limit_mb']}")))
                return
            conn.send_bytes(to_wire(verdict))


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[2]))
    # A terminal's Ctrl-C reaches the whole process group; the trainer decides what it means (save, then stop).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(Connection(int(sys.argv[1])))
