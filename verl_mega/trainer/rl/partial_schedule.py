"""Partial rollouts in the trainer: `rollout.mode: async` with `rollout.partial: finish | abort`.

Each rollout replica drives a `PartialRollout` over its share of every round of prompts, in chunks of
`rollout.partial_chunk_tokens`; finished responses become groups (`PendingGroups`) in the trajectory buffer, and a
step takes the oldest data.batch_size groups at most `rollout.max_staleness` versions old. The same schedule runs
at both placements, chunk for chunk, so they train on the same data:

    a chunk          first, a round of data.batch_size new prompts starts (in slot (next round, 0)) if the
                     buffer and the prompts in flight leave room for it ((max_staleness + 1) x batch_size groups
                     in all); then every in-flight sequence gets up to partial_chunk_tokens more tokens, and the
                     groups that finished go into the buffer. Rounds thus start a chunk or more apart.
    a step's start   the engines hold the step's weights (version v); sequences still in flight take them:
                     `finish` goes on under them (each token keeps the version and log-prob that sampled it),
                     `abort` starts again from the prompt.
    take             chunks until the buffer holds batch_size groups at most max_staleness versions old
    ahead            (max_staleness >= 1) chunks until the buffer holds the next step's groups: colocated at
                     once, in the rollout engine's awake window; with rollout ranks while the training ranks train
                     (`settle` waits for them before the push). What is still in flight when the next weights
                     arrive is what `rollout.partial` acts on.

A round's first chunk is seeded by its slot as a whole-round generation is, so at max_staleness 0 with a chunk of
data.max_response_length tokens or more this is `sync`, bit for bit (without dynamic sampling, whose later rounds
take slots of their own here); shorter chunks re-prefill and seed each chunk's call of their own (see
`rollout.partial`), so they sample other tokens.

Where the partial rollouts live depends on the placement: `LocalChunks` (on the training ranks, colocated, here)
or `trainer.rl.remote.RemoteChunks` (on the rollout ranks). Both answer `chunk()` with every replica's
finished responses, in replica order, on every training rank. The job state holds the buffer, the prompts in
flight and every replica's partial rollout, so a checkpoint taken with sequences in flight resumes exactly.
"""
from __future__ import annotations

import functools
from typing import Callable, Protocol, Sequence

import torch.distributed as dist

from verl_mega.parallel.layout import RolloutCoordinates
from verl_mega.rollout.engine import Response, RolloutEngine, SamplingParams
from verl_mega.rollout.partial import PartialRollout
from verl_mega.files.plain_state import entry, ints
from verl_mega.rollout.trajectory_buffer import UNBOUNDED, PendingGroups, RunBounds

from ..metrics import StageTimer
from .schedule import BufferedSchedule, GeneratedRound, as_round

Draw = Callable[[], tuple[list[int], list[list[int]]]]  # the next round: sampler indices and prompt token ids
Seeds = Callable[[int, int], list[int]]  # slot (step, round) -> each replica's seed of its first chunk


class Chunks(Protocol):
    """The replicas' partial rollouts, wherever they run (see the module docstring)."""

    replicas: int

    def advance(self, version: int) -> None: ...
    def start(self, shares: list[list[list[int]]], seeds: list[int], version: int) -> None: ...
    def chunk(self, timer: StageTimer) -> list[list[Response]]: ...
    def ahead(self, work: Callable[[Callable[[], list[list[Response]]]], None], timer: StageTimer) -> None: ...
    def join(self, progress: Callable[[], dict]) -> dict | None: ...
    def states(self) -> list[dict]: ...
    def load_states(self, states: list[dict], bounds: RunBounds) -> None: ...


class PartialSchedule(BufferedSchedule):
    """The async schedule of partial rollouts (see the module docstring); `draw` and `seeds` are the job's."""

    def __init__(self, max_staleness: int, batch_size: int, n: int, chunks: Chunks, draw: Draw, seeds: Seeds):
        super().__init__(max_staleness, batch_size, n, buffered=True)
        self.chunks, self.draw, self.seeds = chunks, draw, seeds
        self.pending = [PendingGroups(n) for _ in range(chunks.replicas)]
        self.started = [0] * chunks.replicas  # prompts started on each replica: its partial rollout's next index

    def fill(self, timer: StageTimer, version: int) -> None:
        """A step's start: in-flight sequences take the weights of `version` (the engines hold them)."""
        self.chunks.advance(version)

    def take(self, step: int, gen_round: int, timer: StageTimer, version: int) -> GeneratedRound:
        """The buffer's oldest batch_size groups at most max_staleness versions old, chunks run until it has
        them."""
        while (groups := self.buffer.take(self.batch_size, version, self.staleness)) is None:
            self._chunk(lambda: self.chunks.chunk(timer), version)
        return as_round(groups)

    def ahead(self, timer: StageTimer, version: int) -> None:
        """The next step's groups, generated by `version`'s weights (none at max_staleness 0: they would be
        dropped as stale)."""
        if self.staleness > 0:
            self.chunks.ahead(functools.partial(self._run_ahead, version), timer)

    def settle(self) -> None:
        """Wait for the groups generated ahead; every training rank then holds the leader's, its sampler drawn as
        far."""
        shared = self.chunks.join(self._progress)
        if shared is not None:
            for _ in range(shared["next_step"] - self.next_step):
                self.draw()
            self._take_progress(self._checked_progress(shared, UNBOUNDED))

    def in_flight_groups(self) -> int:
        return sum(len(pending) for pending in self.pending)

    def state_dict(self) -> dict:
        """The buffer, the prompts in flight and every replica's partial rollout (collective)."""
        return {**self._progress(), "rollouts": self.chunks.states()}

    def load_state_dict(self, state: dict, bounds: RunBounds) -> None:
        """The saved schedule, every entry checked against `bounds` (the replicas' partial rollouts too) before
        any is taken or sent on: a bad one is a ValueError naming its key under `rollout_schedule`."""
        what = "rollout_schedule"
        rollouts = state.get("rollouts") if isinstance(state, dict) else None
        if not isinstance(rollouts, list) or len(rollouts) != self.chunks.replicas:
            raise ValueError(f"{what}.rollouts holds no partial rollouts of {self.chunks.replicas} rollout replicas "
                             "(it was saved with another rollout.partial or parallel layout)")
        progress = self._checked_progress(state, bounds)
        self.chunks.load_states(rollouts, bounds)
        self._take_progress(progress)

    # --- helpers ----------------------------------------------------------------------------------------

    def _chunk(self, chunk: Callable[[], list[list[Response]]], version: int) -> None:
        """One chunk, a round of new prompts started first where the buffer and the prompts in flight leave room
        for it: rounds start a chunk apart, so the weights of a step arrive with sequences part-way."""
        if len(self.buffer) + self.in_flight_groups() + self.batch_size <= self.buffer.capacity:
            self._start(self.draw(), self.seeds(self.next_step, 0), version)
            self.next_step += 1
        elif not self.in_flight_groups():
            raise RuntimeError("the trajectory buffer is full of groups no step can take")
        self._file(chunk())

    def _start(self, drawn: tuple[list[int], list[list[int]]], seeds: list[int], version: int) -> None:
        """A round's prompts, split over the replicas as a whole-round generation splits them."""
        indices, prompts = drawn
        share = len(indices) // self.chunks.replicas
        shares = [prompts[r * share:(r + 1) * share] for r in range(self.chunks.replicas)]
        for replica, pending in enumerate(self.pending):
            for offset, index in enumerate(indices[replica * share:(replica + 1) * share]):
                pending.expect(self.started[replica] + offset, index, {})
            self.started[replica] += share
        self.chunks.start(shares, seeds, version)

    def _file(self, finished: Sequence[list[Response]]) -> None:
        """One chunk's finished responses into their groups; complete groups into the buffer, replica by replica."""
        for pending, responses in zip(self.pending, finished):
            for group in pending.add(responses):
                if not self.buffer.put(group):  # `_chunk` leaves room for every prompt in flight
                    raise RuntimeError("the trajectory buffer is full with prompts still in flight")

    def _run_ahead(self, version: int, chunk: Callable[[], list[list[Response]]]) -> None:
        while len(self.buffer) < self.batch_size:
            self._chunk(chunk, version)

    def _progress(self) -> dict:
        """The training side's part of the state: buffer, slots, prompts in flight."""
        return {"next_step": self.next_step, "buffer": self.buffer.state_dict(), "started": list(self.started),
                "pending": [pending.state_dict() for pending in self.pending]}

    def _checked_progress(self, state: dict, bounds: RunBounds) -> tuple:
        """The training side's part of a saved state, every entry checked against `bounds` (UNBOUNDED: the
        leader's own state, shared after running ahead); nothing changes here."""
        what = "rollout_schedule"
        started = ints(entry(state, "started", list, what), f"{what}.started", low=0)
        saved = entry(state, "pending", list, what)
        if len(started) != len(saved) or len(saved) != self.chunks.replicas:
            raise ValueError(f"{what}.pending holds {len(saved)} replicas' prompts in flight, this run has "
                             f"{self.chunks.replicas}")
        pending = [PendingGroups(self.n) for _ in saved]
        for replica, (group, replica_state) in enumerate(zip(pending, saved)):
            group.load_state_dict(replica_state, bounds, f"{what}.pending[{replica}]")
        return started, pending, *self.checked_state(state, bounds)

    def _take_progress(self, progress: tuple) -> None:
        self.started, self.pending, self.next_step, self.buffer = progress


class LocalChunks:
    """Colocated: this rank's replica's partial rollout on the HybridEngine's rollout engine (every rank of a
    replica drives the same one); each chunk gathers every replica's finished responses on every rank."""

    def __init__(self, engine: RolloutEngine, params: SamplingParams, chunk_tokens: int, policy: str,
                 eos_token_ids: Sequence[int], coordinates: RolloutCoordinates, world_size: int):
        self.partial = PartialRollout(engine, params, chunk_tokens, eos_token_ids=eos_token_ids)
        self.policy, self.coordinates, self.world_size = policy, coordinates, world_size
        self.replicas = coordinates.replicas

    def advance(self, version: int) -> None:
        """The engine holds `version`'s weights (the step's transition loaded them)."""
        if version > self.partial.version:
            self.partial.update_weights(version, self.policy)

    def start(self, shares: list[list[list[int]]], seeds: list[int], version: int) -> None:
        replica = self.coordinates.replica
        self.partial.start(shares[replica], version, seed=seeds[replica])

    def chunk(self, timer: StageTimer) -> list[list[Response]]:
        with timer("rollout"):
            return self._gather(self.partial.step())

    def ahead(self, work, timer: StageTimer) -> None:
        work(lambda: self.chunk(timer))

    def join(self, progress) -> None:
        """Nothing runs behind the step's back here."""

    def states(self) -> list[dict]:
        return self._gather(self.partial.state_dict())

    def load_states(self, states: list[dict], bounds: RunBounds) -> None:
        self.partial.load_state_dict(states[self.coordinates.replica], bounds,
                                     f"rollout_schedule.rollouts[{self.coordinates.replica}]")

    def _gather(self, mine) -> list:
        """Collective: each replica's `mine` (its leader's), in replica order."""
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (self.coordinates.replica, self.coordinates.leads_replica, mine))
        by_replica = {replica: value for replica, leads, value in gathered if leads}
        return [by_replica[replica] for replica in range(self.replicas)]
