"""Two worlds and a bridge: the disaggregated placement's process groups.

torch allows one default process group per process and megatron's `initialize_model_parallel` spans all of it,
so each role gets a default world of its own: the training ranks' (megatron's groups, as colocated runs have
them) and the rollout ranks' (their engines' rollout TP). Both are made from the one rendezvous store torchrun
or Slurm gives the job, each under its own `PrefixStore`, and so is the *bridge*: a process group over every
global rank through which the training ranks push weights to the rollout ranks and the roles exchange objects.

The bridge is a backend object used through its own point-to-point calls, never registered with
torch.distributed: its ranks are global ranks, which no default world knows, and a registered group would have
to span the default world. Every call waits at most `parallel.bridge_timeout_s`; a peer that died or hangs
raises `PeerFailed`, one line naming its role, rank, pid and host.
"""
from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layout import RolePlacement
from .state import backend, device, export_world, select_local_device
from .torchrun import exit_with_agent
from .world import World, read_world

STORE_PREFIX = "verl_mega"


class PeerFailed(RuntimeError):
    """A rank across the bridge died or did not answer in time (the message names it)."""


@dataclass(frozen=True)
class Peer:
    """Who a global rank is, for the message that names it when it fails."""

    rank: int
    role: str
    pid: int
    host: str

    def __str__(self) -> str:
        return f"{self.role} rank {self.rank} (pid {self.pid} on {self.host})"


def init_placement(placement: RolePlacement, timeout_minutes: int = 30, bridge_timeout_s: float = 600.0) -> "Bridge":
    """Start this process's role world as the default process group (training ranks then call `init_parallel`
    as colocated runs do; it finds the group made) and the bridge over every global rank. The world is
    exported as torchrun's variables of the role's world (RANK = rank in role), which vLLM's external launcher
    reads."""
    if not placement.disaggregated:
        raise ValueError("a colocated placement (parallel.rollout_ranks=0) has no bridge: call init_parallel")
    if dist.is_initialized():
        raise RuntimeError("init_placement must come before any process group (init_parallel included)")
    exit_with_agent()
    world = read_world()
    if (world.rank, world.size) != (placement.global_rank, placement.global_size):
        raise ValueError(f"the placement is for rank {placement.global_rank} of {placement.global_size} but this "
                         f"process is rank {world.rank} of {world.size}")
    select_local_device(world.local_rank)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store, _, _ = next(dist.rendezvous(world.init_method, world.rank, world.size, timeout=timeout))
    export_world(World(placement.rank_in_role, world.local_rank, placement.role_size, world.master_addr,
                       world.master_port))
    dist.init_process_group(backend(), store=dist.PrefixStore(f"{STORE_PREFIX}/{placement.role}", store),
                            rank=placement.rank_in_role, world_size=placement.role_size, timeout=timeout)
    return Bridge(placement, dist.PrefixStore(f"{STORE_PREFIX}/bridge", store), bridge_timeout_s)


def _new_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    """A backend over `size` ranks of `store`, created by those ranks alone."""
    if backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class Bridge:
    """Point-to-point and broadcast calls over global ranks, each bounded by the bridge timeout."""

    def __init__(self, placement: RolePlacement, store: dist.Store, timeout_s: float):
        self.placement = placement
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device()
        self._store = store
        self._group = _new_group(store, placement.global_rank, placement.global_size, self.timeout)
        self._subgroups: dict[tuple[int, ...], object] = {}
        self.peers = self._introduce()

    def _introduce(self) -> tuple[Peer, ...]:
        """Every rank's pid and host, published once through the store (this waits for all ranks)."""
        me = self.placement
        self._store.set(f"peer/{me.global_rank}", json.dumps({"role": me.role, "pid": os.getpid(),
                                                               "host": socket.gethostname()}))
        found = [json.loads(self._store.get(f"peer/{rank}")) for rank in range(me.global_size)]
        return tuple(Peer(rank, str(info["role"]), int(info["pid"]), str(info["host"]))
                     for rank, info in enumerate(found))

    # --- the calls --------------------------------------------------------------------------------------

    def send_tensor(self, tensor: torch.Tensor, dst: int) -> None:
        self._wait(lambda: self._group.send([tensor], dst, 0), (dst,))

    def recv_tensor(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into `tensor` (its shape and dtype are the sender's) and return it."""
        self._wait(lambda: self._group.recv([tensor], src, 0), (src,))
        return tensor

    def send_bytes(self, data: bytes, dst: int) -> None:
        self.send_tensor(torch.tensor([len(data)], dtype=torch.int64, device=self.device), dst)
        self.send_tensor(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device), dst)

    def recv_bytes(self, src: int) -> bytes:
        size = int(self.recv_tensor(torch.empty(1, dtype=torch.int64, device=self.device), src).item())
        if size < 0:
            raise PeerFailed(f"{self.peers[src]} sent a message of {size} bytes")
        return self.recv_tensor(torch.empty(size, dtype=torch.uint8, device=self.device), src).cpu().numpy().tobytes()

    def send_object(self, obj, dst: int) -> None:
        """Send a picklable object; the bridge joins the job's own processes only."""
        self.send_bytes(pickle.dumps(obj), dst)

    def recv_object(self, src: int):
        return pickle.loads(self.recv_bytes(src))

    def broadcast_tensor(self, tensor: torch.Tensor, src: int, ranks) -> torch.Tensor:
        """Broadcast `tensor` from global rank `src` to the global `ranks` (src among them), in place; every one
        of them calls it alike."""
        ranks = tuple(sorted(ranks))
        if src not in ranks or self.placement.global_rank not in ranks:
            raise ValueError(f"broadcast from rank {src} over ranks {ranks}: source and caller must be among them")
        group = self._group if len(ranks) == self.placement.global_size else self._subgroup(ranks)
        others = tuple(rank for rank in ranks if rank != src) if self.placement.global_rank == src else (src,)
        self._wait(lambda: group.broadcast([tensor], _broadcast_options(ranks.index(src), self.timeout)), others)
        return tensor

    def close(self) -> None:
        """Drop the bridge's groups (the role's default world is `destroy_parallel`'s)."""
        self._subgroups.clear()
        self._group = None

    # --- helpers ----------------------------------------------------------------------------------------

    def _subgroup(self, ranks: tuple[int, ...]):
        if ranks not in self._subgroups:
            store = dist.PrefixStore(f"group/{'-'.join(map(str, ranks))}", self._store)
            self._subgroups[ranks] = _new_group(store, ranks.index(self.placement.global_rank), len(ranks),
                                                self.timeout)
        return self._subgroups[ranks]

    def _wait(self, start, peers: tuple[int, ...]) -> None:
        """Run `start()` (which posts the operation) and wait for it: gloo raises a dead peer's error from either."""
        try:
            start().wait(self.timeout)
        except RuntimeError as error:  # gloo and NCCL raise it (DistBackendError is one) for death and timeout
            raise PeerFailed(self._failure(peers, error)) from None

    def _failure(self, peers: tuple[int, ...], error: Exception) -> str:
        who = ", ".join(str(self.peers[rank]) for rank in peers)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"{who} did not answer within {self.timeout.total_seconds():g} s: {reason}"


def _broadcast_options(root: int, timeout: datetime.timedelta) -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.timeout = timeout
    return options
