"""Who this process is in its job: rank, local rank, world size and the rendezvous, read from the environment.

One reader for every way the package is started, in this order:
- torchrun (or anything that sets its variables): RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
- Slurm tasks started by `srun` without torchrun: SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, the first host of
  the step's node list (where task 0 runs) and a port derived from SLURM_JOB_ID, so that every task agrees on
  the rendezvous without talking to the others;
- otherwise a single process on this machine.
An exported MASTER_ADDR / MASTER_PORT is used as it is in every case. `init_parallel` builds its process group
from this and the pre-flight check sizes the config by it, so both see the same world.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .spawn import free_port

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LOCAL_HOST = "127.0.0.1"
# torchrun's default when a launcher sets the world but not the port.
TORCHRUN_DEFAULT_PORT = 29500
# launch/templates/sbatch.sh derives its MASTER_PORT the same way: two jobs that share a first node differ, and
# so do two runs of one requeued job (SLURM_RESTART_COUNT): a predecessor's rendezvous store still dying on that
# node cannot capture its successor.
SLURM_PORT_BASE, SLURM_PORT_SPAN, SLURM_PORT_RESTART_STRIDE = 15000, 20000, 10007
# The step's nodes first: a step may run on part of the job's allocation.
SLURM_NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")


@dataclass(frozen=True)
class World:
    """This process's place in its job and where the job's processes meet."""

    rank: int
    local_rank: int
    size: int
    master_addr: str
    master_port: int

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    def torchrun_environment(self) -> dict[str, str]:
        """The world as torchrun's variables, which torch's env:// rendezvous and vLLM's external launcher read."""
        values = (self.rank, self.local_rank, self.size, self.master_addr, self.master_port)
        return dict(zip(TORCHRUN_VARIABLES, map(str, values), strict=True))


def read_world(env: Mapping[str, str] = os.environ) -> World:
    """This process's world from `env` (torchrun's variables, else Slurm's, else a single process); raises
    ValueError naming a variable that is not a number or a node list that cannot be read."""
    if "WORLD_SIZE" in env:
        size = _integer(env, "WORLD_SIZE")
        return _world(env, _integer(env, "RANK", 0), _integer(env, "LOCAL_RANK", 0), size, lambda: LOCAL_HOST,
                      lambda: TORCHRUN_DEFAULT_PORT if size > 1 else free_port())
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _world(env, _integer(env, "SLURM_PROCID"), _integer(env, "SLURM_LOCALID", 0),
                      _integer(env, "SLURM_NTASKS"), lambda: first_host(_slurm_nodelist(env)), lambda: slurm_port(env))
    # A process of its own (a script, the Python API) picks a free port: no other rank has to find it, and a
    # fixed one collides with any other job on the machine.
    return _world(env, 0, 0, 1, lambda: LOCAL_HOST, free_port)


def single_process_world() -> World:
    """A world of this process alone, whatever the environment says (a plain export's read of a checkpoint)."""
    return World(0, 0, 1, LOCAL_HOST, free_port())


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list in its compressed syntax: 'gpu[01-04,07],cpu3' -> 'gpu01',
    'rack[1-2]-n[08-09]' -> 'rack1-n08', the host `scontrol show hostnames` lists first."""
    text = nodelist.strip()
    entry = re.match(r"(?:[^,\[]|\[[^\]]*\])*", text)
    host = re.sub(r"\[(\w+)[^\]]*\]", r"\1", entry.group(0))
    if entry.end() < len(text) and text[entry.end()] != "," or not re.fullmatch(r"[\w.-]+", host):
        raise ValueError(f"node list {nodelist!r} is not in Slurm's syntax (like gpu[01-04,07],cpu3)")
    return host


def slurm_port(env: Mapping[str, str]) -> int:
    """The rendezvous port every task of a Slurm job's run derives alike from the job id and restart count."""
    offset = _integer(env, "SLURM_JOB_ID") + SLURM_PORT_RESTART_STRIDE * _integer(env, "SLURM_RESTART_COUNT", 0)
    return SLURM_PORT_BASE + offset % SLURM_PORT_SPAN


def _slurm_nodelist(env: Mapping[str, str]) -> str:
    for name in SLURM_NODELIST_VARIABLES:
        if env.get(name):
            return env[name]
    raise ValueError(f"SLURM_PROCID is set but none of {', '.join(SLURM_NODELIST_VARIABLES)}: export MASTER_ADDR")


def _world(env: Mapping[str, str], rank: int, local_rank: int, size: int, default_addr: Callable[[], str],
           default_port: Callable[[], int]) -> World:
    """The world with an exported MASTER_ADDR / MASTER_PORT taking the place of the launcher's defaults."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a world of {size} processes")
    port = _integer(env, "MASTER_PORT") if env.get("MASTER_PORT") else default_port()
    return World(rank, local_rank, size, env.get("MASTER_ADDR") or default_addr(), port)


def _integer(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not an integer" if value is not None else f"{name} is not set") from None
