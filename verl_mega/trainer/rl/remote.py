"""The training ranks' side of disaggregated placement (`parallel.rollout_ranks`): `RemoteRollout` pushes the
actor's weights to the rollout ranks and asks them for rounds, and `RemoteChunks` drives their partial rollouts;
the messages and the rollout ranks' loop are `trainer.rl.rollout_service`'s. Every training rank calls each method
alike; the first one (the leader) talks to the rollout ranks, and the answers reach every training rank."""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch
import torch.distributed as dist

from verl_mega.parallel.bridge import Bridge
from verl_mega.parallel.layout import RolePlacement
from verl_mega.parallel.state import device
from verl_mega.rollout.engine import Response, SamplingParams
from verl_mega.rollout.hybrid_engine import HybridEngine
from verl_mega.rollout.partial import PartialRollout
from verl_mega.rollout.trajectory_buffer import RunBounds
from verl_mega.rollout.weight_push import push_weights

from ..metrics import StageTimer
from .rollout_service import Busy, leader, replica_bounds, replica_leaders, replica_messages
from .schedule import Pending


class RemoteRollout:
    """The training ranks' side: every training rank calls each method alike (see the module docstring)."""

    def __init__(self, bridge: Bridge, placement: RolePlacement, hybrid: HybridEngine, bucket_mb: float,
                 verify: bool = False):
        self.bridge, self.placement, self.hybrid, self.bucket_mb = bridge, placement, hybrid, bucket_mb
        self.verify = verify
        self.leads = placement.global_rank == leader(placement)
        self.version = None  # of the weights the rollout ranks hold
        self.verified_tensors = 0  # of the last push (with `verify`): tensors checked alike, over every rollout rank
        self.waiter = ThreadPoolExecutor(max_workers=1) if self.leads else None
        feed = hybrid.feed
        self._tell(("build", feed.padded_vocab, feed.vocab_size))

    @property
    def replicas(self) -> int:
        return self.placement.replicas

    def push(self, version: int) -> None:
        """The actor's weights after `version` optimizer steps to every rollout rank (collective on the training
        ranks: the HybridEngine's stream needs them all)."""
        self._tell(("weights", version))
        verified = push_weights(self.bridge, self.hybrid, self.placement, version, self.bucket_mb, self.verify)
        if self.verify:
            self.verified_tensors = summed(verified)
        self.version = version

    def request(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> Pending:
        """Replica r generates its share r of `prompts` (contiguous, as even as the count allows) under
        `params[r]`; the Pending's result is every response, in replica order, each prompt_index counted over all
        `prompts`, and the `Busy` seconds of the busiest replica generating and loading weights for it."""
        bounds = replica_bounds(len(prompts), self.replicas)
        shares = [list(prompts[bounds[r]:bounds[r + 1]]) for r in range(self.replicas)]
        # The leader's thread sends too: a send waits for a rollout rank still busy with an earlier round.
        waiting = self.waiter.submit(self._generated, shares, params, bounds) if self.leads else None
        return Pending(lambda: self._shared(waiting))

    def close(self) -> None:
        self._tell(("stop",))
        if self.waiter is not None:
            self.waiter.shutdown()

    def _generated(self, shares: list[list[list[int]]], params: Sequence[SamplingParams], bounds: list[int]
                   ) -> tuple[list[Response], "Busy"]:
        for rank, message in replica_messages(self.placement, lambda replica: ("generate", shares[replica],
                                                                                 params[replica])):
            self.bridge.send_object(message, rank)
        responses, busy = [], []
        for replica, rank in enumerate(replica_leaders(self.placement)):
            answered, seconds = self.bridge.recv_object(rank)
            responses += [dataclasses.replace(response, prompt_index=bounds[replica] + response.prompt_index)
                          for response in answered]
            busy.append(seconds)
        return responses, Busy.busiest(busy)

    def _shared(self, waiting) -> tuple[list[Response], "Busy"]:
        """Collective on the training ranks: the leader's responses on every one of them."""
        return self.shared(waiting.result() if waiting is not None else None)

    @staticmethod
    def shared(value):
        """Collective on the training ranks: the leader's `value` on every one of them."""
        if dist.get_world_size() == 1:
            return value
        shared = [value]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]

    def _tell(self, message: tuple) -> None:
        if self.leads:
            for rank in self.placement.rollout_ranks:
                self.bridge.send_object(message, rank)


def summed(count: int) -> int:
    """Collective on the training ranks: the sum of every one's `count`."""
    total = torch.tensor([count], dtype=torch.int64, device=device())
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    return int(total.item())


class RemoteChunks:
    """The replicas' partial rollouts on the rollout ranks, for `PartialSchedule` (see the module docstring): the
    leader sends, and every training rank gets the answers; `ahead` chunks in the leader's thread while the
    training ranks train."""

    def __init__(self, remote: RemoteRollout, params: Sequence[SamplingParams], chunk_tokens: int, policy: str,
                 eos_token_ids: Sequence[int]):
        self.remote, self.replicas = remote, remote.replicas
        # The rollout ranks' partial rollouts, unbuilt here: what checks a saved state before it is sent on.
        self.checkers = [PartialRollout(None, replica_params, chunk_tokens, eos_token_ids=eos_token_ids)
                         for replica_params in params]
        self.running = None  # the leader's chunks ahead, and the step's timer they count into
        self.ahead_busy = Busy()  # the rollout ranks' seconds for them
        self._to_replicas(lambda replica: ("partial", params[replica], chunk_tokens, policy, list(eos_token_ids)))

    def advance(self, version: int) -> None:
        """Nothing to do: the rollout ranks take new weights with the push."""

    def start(self, shares: list[list[list[int]]], seeds: list[int], version: int) -> None:
        if version != self.remote.version:
            raise RuntimeError(f"prompts start at version {version}, the rollout ranks hold {self.remote.version}")
        self._to_replicas(lambda replica: ("start", shares[replica], seeds[replica]))

    def chunk(self, timer: StageTimer) -> list[list[Response]]:
        with timer("rollout_wait"):
            answered = self._exchange() if self.remote.leads else None
            finished, busy = self.remote.shared(answered)
        busy.count_into(timer)
        return finished

    def ahead(self, work, timer: StageTimer) -> None:
        """`work` in the leader's thread, on the leader's schedule; the rollout ranks' seconds for it count in
        the step's `rollout_ranks_busy` when it is joined."""
        if self.remote.leads:
            self.running = (self.remote.waiter.submit(work, self._exchange_ahead), timer)

    def _exchange_ahead(self) -> list[list[Response]]:
        finished, busy = self._exchange()
        self.ahead_busy += busy
        return finished

    def join(self, progress) -> dict | None:
        """Wait for the chunks ahead; with several training ranks, the leader's progress for the others (None on
        the leader, which has it)."""
        running, self.running = self.running, None
        if running is not None:
            running[0].result()
            self.ahead_busy.count_into(running[1])
            self.ahead_busy = Busy()
        if dist.get_world_size() == 1:
            return None
        shared = self.remote.shared(progress() if self.remote.leads else None)
        return None if self.remote.leads else shared

    def states(self) -> list[dict]:
        states = None
        if self.remote.leads:
            self._to_replicas(lambda replica: ("partial_state",))
            states = [self.remote.bridge.recv_object(rank) for rank in replica_leaders(self.remote.placement)]
        return self.remote.shared(states)

    def load_states(self, states: list[dict], bounds: RunBounds) -> None:
        """Each replica's saved state, checked here first (against `bounds`): a bad one is a ValueError naming
        it, and nothing is sent."""
        for replica, (checker, state) in enumerate(zip(self.checkers, states)):
            checker.load_state_dict(state, bounds, f"rollout_schedule.rollouts[{replica}]")
        self._to_replicas(lambda replica: ("load_partial", states[replica]))

    def _exchange(self) -> tuple[list[list[Response]], "Busy"]:
        """The leader: one chunk on every replica, its finished responses by replica, and the busiest one's
        seconds."""
        self._to_replicas(lambda replica: ("chunk",))
        answers = [self.remote.bridge.recv_object(rank) for rank in replica_leaders(self.remote.placement)]
        return [finished for finished, _ in answers], Busy.busiest([busy for _, busy in answers])

    def _to_replicas(self, message_for) -> None:
        if self.remote.leads:
            for rank, message in replica_messages(self.remote.placement, message_for):
                self.remote.bridge.send_object(message, rank)
