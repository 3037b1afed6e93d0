"""Disaggregated placement (`parallel.rollout_ranks`): the rollout ranks' loop and the training ranks' client.

The rollout ranks run only a rollout engine (embedded or vLLM, at parallel.rollout_tp) and obey the first
training rank (the leader), message by message over the bridge:

    ("build", padded_vocab, vocab_size)   build the engine for the actor's vocabulary (once, first)
    ("weights", version)                  receive the training ranks' push (`rollout.weight_push`), load it
    ("generate", prompts, params)         generate; the replica's first rank sends the responses back, with the
                                          seconds (wall and CPU, `Busy`) it spent generating and loading weights
                                          since its last answer
    ("stop",)                             return

With partial rollouts (`trainer.partial_schedule`) each replica drives a `PartialRollout` on its engine:

    ("partial", params, chunk_tokens, policy, eos_token_ids)   make it (once, after build)
    ("start", prompts, seed)              put the replica's share of a round in flight, at the weights held
    ("chunk",)                            one chunk; the replica's first rank sends back the finished responses
                                          (and its busy seconds)
    ("partial_state",) / ("load_partial", state)   the replica's first rank sends its state / every rank loads one

and a weight push (`weights`) is taken between two chunks: the sequences in flight go on under the new weights
or start again (`rollout.partial`).

The client on the training ranks sends them and hands the responses to every training rank. A request returns
at once (`Pending`): a thread of the leader's sends it and waits for the responses while the training ranks train,
and every training rank takes them when the step settles (`RolloutSchedule.settle`), so in one_step_off the
rollout ranks generate the next batch while the training ranks train on this one. The reward stays on the
training side.

Failures: a rollout rank that dies or hangs makes the leader's wait raise `PeerFailed` naming it, which stops
the run; a training rank that dies leaves the rollout ranks' next receive to raise it, and they exit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch
import torch.distributed as dist

from verl_mega.models import load_hf_model_config
from verl_mega.models.builder import DTYPES
from verl_mega.parallel.bridge import Bridge
from verl_mega.parallel.placement import Placement
from verl_mega.parallel.state import device
from verl_mega.rollout.engine import Response, SamplingParams
from verl_mega.rollout.factory import make_rollout_engine, resolve_rollout_dtype
from verl_mega.rollout.hybrid_engine import HybridEngine
from verl_mega.rollout.partial import PartialRollout
from verl_mega.rollout.weight_push import push_weights, receive_weights, rollout_feed

from .metrics import StageTimer
from .rollout_schedule import Pending


def leader(placement: Placement) -> int:
    """The training rank that talks to the rollout ranks."""
    return placement.train_ranks[0]


def replica_leaders(placement: Placement) -> list[int]:
    """The first global rank of each rollout replica: it sends its replica's responses back."""
    return list(placement.rollout_ranks[::placement.rollout_tp])


def replica_messages(placement: Placement, message_for) -> list[tuple[int, tuple]]:
    """(rollout rank, message) for every rollout rank, in rank order: `message_for(replica)` of its replica, so
    the rollout TP ranks of a replica get the same one."""
    return [(rank, message_for(placement.rollout_coordinates(rank)[0])) for rank in placement.rollout_ranks]


def replica_bounds(prompts: int, replicas: int) -> list[int]:
    """Where each replica's contiguous share of `prompts` prompts starts (and the last one ends): as even as the
    count allows."""
    return [replica * prompts // replicas for replica in range(replicas + 1)]


@dataclasses.dataclass(frozen=True)
class Busy:
    """A rollout replica's seconds generating and loading weights: wall time and its process's CPU time (which a
    wait for a core does not add to, and a wait for memory does)."""

    wall: float = 0.0
    cpu: float = 0.0

    def __add__(self, other: "Busy") -> "Busy":
        return Busy(self.wall + other.wall, self.cpu + other.cpu)

    @staticmethod
    def busiest(answers: list["Busy"]) -> "Busy":
        return max(answers, key=lambda busy: busy.wall, default=Busy())

    def count_into(self, timer: StageTimer) -> None:
        """The step's `timing/rollout_ranks_busy` (wall) and `timing/rollout_ranks_cpu`."""
        timer.add("rollout_ranks_busy", self.wall)
        timer.add("rollout_ranks_cpu", self.cpu)


class RolloutService:
    """A rollout rank's loop (see the module docstring)."""

    def __init__(self, config, bridge: Bridge, placement: Placement):
        self.config, self.bridge, self.placement = config, bridge, placement
        self.engine = None
        self.partial: PartialRollout | None = None
        self.policy = "finish"
        self.version = -1
        self.busy = Busy()  # generating and loading weights, since the last answer

    def serve(self) -> None:
        """Obey the leader until it says stop; PeerFailed (the leader died or went silent) ends the loop too."""
        source = leader(self.placement)
        while True:
            message = self.bridge.recv_object(source)
            if message[0] == "stop":
                break
            getattr(self, f"on_{message[0]}")(*message[1:])
        if self.engine is not None:
            self.engine.close()

    def on_build(self, padded_vocab: int, vocab_size: int) -> None:
        config = self.config
        hf_config, _ = load_hf_model_config(config.model.hf_path, config.model.family_spec or None)
        dtype = DTYPES[resolve_rollout_dtype(config.rollout.engine, config.rollout.dtype, config.model.dtype)]
        self.engine = make_rollout_engine(config.rollout.engine, config.model.hf_path, hf_config.raw,
                                          rollout_feed(self.placement, padded_vocab, vocab_size),
                                          max_model_len=config.data.max_prompt_length
                                          + config.data.max_response_length, dtype=dtype,
                                          gpu_memory_utilization=config.rollout.gpu_memory_utilization)

    def on_weights(self, version: int) -> None:
        self.version, stream = receive_weights(self.bridge, self.placement, self.config.parallel.weight_push_bucket_mb)
        with self._busy():
            self.engine.wake_up(["weights"])
            self.engine.load_weights(stream)
            self.engine.wake_up(["kv_cache"])
            if self.partial is not None and self.version > self.partial.version:
                self.partial.update_weights(self.version, self.policy)

    def on_generate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        with self._busy():
            responses = self.engine.generate(prompts, params) if prompts else []
        self._answer_with_busy(responses)

    def on_partial(self, params: SamplingParams, chunk_tokens: int, policy: str, eos_token_ids: list[int]) -> None:
        self.partial = PartialRollout(self.engine, params, chunk_tokens, eos_token_ids=eos_token_ids)
        self.policy = policy

    def on_start(self, prompts: list[list[int]], seed: int) -> None:
        self.partial.start(prompts, self.version, seed=seed)

    def on_chunk(self) -> None:
        with self._busy():
            finished = self.partial.step()
        self._answer_with_busy(finished)

    def on_partial_state(self) -> None:
        self._answer(self.partial.state_dict())

    def on_load_partial(self, state: dict) -> None:
        self.partial.load_state_dict(state)

    @contextlib.contextmanager
    def _busy(self):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.busy += Busy(time.perf_counter() - wall, time.process_time() - cpu)

    def _answer_with_busy(self, responses: list[Response]) -> None:
        self._answer((responses, self.busy))
        self.busy = Busy()

    def _answer(self, message) -> None:
        """The replica's first rank answers the leader (the replica's other ranks hold the same)."""
        if self.placement.global_rank in replica_leaders(self.placement):
            self.bridge.send_object(message, leader(self.placement))


class RemoteRollout:
    """The training ranks' side: every training rank calls each method alike (see the module docstring)."""

    def __init__(self, bridge: Bridge, placement: Placement, hybrid: HybridEngine, bucket_mb: float,
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

    def load_states(self, states: list[dict]) -> None:
        """Each replica's saved state, checked here first: a bad one is a ValueError naming it, and nothing is
        sent."""
        for checker, state in zip(self.checkers, states):
            checker.load_state_dict(state)
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
