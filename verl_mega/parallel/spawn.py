"""Run a module under torchrun on this machine unless the process is already part of a distributed job."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

from .safe_path import SAFE_PATH_ENV
from .stop_signals import forwarding

# The command line a launcher was started with (shell-quoted), for its ranks to say how the run resumes.
LAUNCH_COMMAND_ENV = "VERL_MEGA_COMMAND"


class StoppedBySignal(Exception):
    """The ranks stopped early on a signal this process passed on to them (and, the trainer's, saved and said
    where): the caller decides whether that ends it too."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

# OMP_NUM_THREADS of a rank whose launcher's environment does not set it.
RANK_THREADS = "1"
# The lowest port `free_port` picks: above the registered services most machines run.
LOWEST_PICKED_PORT = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port free now on 127.0.0.1, for a rendezvous bound a moment later. Picked below the kernel's ephemeral range
    where there is room: a port the kernel hands out may be taken meanwhile by any outgoing connection (gloo opens
    many), which failed a CI run with EADDRINUSE. Drawn from the OS's randomness, not `random`'s state, which a
    seeded job shares with its neighbours."""
    draw, low = random.SystemRandom(), _ephemeral_low()
    for _ in range(64 if low > LOWEST_PICKED_PORT else 0):
        port = draw.randrange(LOWEST_PICKED_PORT, low)
        if _bindable(port):
            return port
    with socket.socket() as sock:  # no room below the range (or no Linux range to read): the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range; LOWEST_PICKED_PORT where it cannot be read."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LOWEST_PICKED_PORT


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def in_distributed_job() -> bool:
    return "WORLD_SIZE" in os.environ


def run_torchrun(nproc: int, module: str, args: list[str], env: dict[str, str] | None = None,
                 capture_output: bool = False) -> subprocess.CompletedProcess:
    """torchrun --nproc-per-node nproc -m module args; raises CalledProcessError (with the output when
    captured) carrying the first failed rank's exit code, its message the last line on stderr. The agent and the
    ranks import nothing from the working folder (`safe_path`). The agent runs in a session of its own and gets
    the stop signals this process receives, once each (`stop_signals`); StoppedBySignal when the ranks then
    ended well."""
    command = torchrun_command(nproc, module, args)
    child_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", RANK_THREADS), **(env or {}),
                 **SAFE_PATH_ENV}
    pipe = subprocess.PIPE if capture_output else None
    with subprocess.Popen(command, env=child_env, stdout=pipe, stderr=pipe, text=capture_output,
                          start_new_session=True) as agent, forwarding(lambda: [agent.pid]) as passed:
        stdout, stderr = agent.communicate()
    if agent.returncode:
        raise subprocess.CalledProcessError(agent.returncode, command, stdout, stderr)
    if passed:
        raise StoppedBySignal(passed[0])
    return subprocess.CompletedProcess(command, 0, stdout, stderr)


def torchrun_command(nproc: int, module: str, args: list[str]) -> list[str]:
    """The command line `run_torchrun` runs: this interpreter's torchrun on a free local port."""
    return [sys.executable, "-m", "verl_mega.parallel.torchrun", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]
