"""Run a module under torchrun on this machine unless the process is already part of a distributed job."""
from __future__ import annotations

import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def in_distributed_job() -> bool:
    return "WORLD_SIZE" in os.environ


def run_torchrun(nproc: int, module: str, args: list[str], env: dict[str, str] | None = None,
                 capture_output: bool = False) -> subprocess.CompletedProcess:
    """torchrun --nproc-per-node nproc -m module args; raises CalledProcessError (with the output when
    captured) carrying the first failed rank's exit code, its message the last line on stderr."""
    command = torchrun_command(nproc, module, args)
    child_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    return subprocess.run(command, check=True, env=child_env, capture_output=capture_output, text=capture_output)


def torchrun_command(nproc: int, module: str, args: list[str]) -> list[str]:
    """The command line `run_torchrun` runs: this interpreter's torchrun on a free local port."""
    return [sys.executable, "-m", "verl_mega.parallel.torchrun", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]
