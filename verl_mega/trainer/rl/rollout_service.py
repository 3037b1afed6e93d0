"""Disaggregated placement (`parallel.rollout_ranks`): the rollout ranks' loop and the training ranks' client.

The rollout ranks run only a rollout engine (embedded or vLLM, at parallel.rollout_tp) and obey the first
training rank (the leader), message by message over the bridge:

    ("build", padded_vocab, vocab_size)   build the engine for the actor's vocabulary (once, first)
    ("weights", version)                  receive the training ranks' push (`rollout.weight_push`), load it
    ("generate", prompts, params)         generate; the replica's first rank sends the responses back, with the
                                          seconds (wall and CPU, `Busy`) it spent generating and loading weights
                                          since its last answer
    ("stop",)                             return

With partial rollouts (`trainer.rl.partial_schedule`) each replica drives a `PartialRollout` on its engine:

    ("partial", params, chunk_tokens, policy, eos_token_ids)   make it (once, after build)
    ("start", prompts, seed)              put the replica's share of a round in flight, at the weights held
    ("chunk",)                            one chunk; the replica's first rank sends back the finished responses
                                          (and its busy seconds)
    ("partial_state",) / ("load_partial", state)   the replica's first rank sends its state / every rank loads one

and a weight push (`weights`) is taken between two chunks: the sequences in flight go on under the new weights
or start again (`rollout.partial`).

The client on the training ranks (`trainer.rl.remote`) sends them and hands the responses to every training rank. A
request returns at once (`Pending`): a thread of the leader's sends it and waits for the responses while the
training ranks train, and every training rank takes them when the step settles (`RolloutSchedule.settle`), so in
one_step_off the rollout ranks generate the next batch while the training ranks train on this one. The reward stays
on the training side.

Failures: a rollout rank that dies or hangs makes the leader's wait raise `PeerFailed` naming it, which stops
the run; a training rank that dies leaves the rollout ranks' next receive to raise it, and they exit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

from verl_mega.models import load_hf_model_config
from verl_mega.models.builder import DTYPES
from verl_mega.parallel.bridge import Bridge
from verl_mega.parallel.layout import RolePlacement
from verl_mega.rollout.engine import Response, SamplingParams
from verl_mega.rollout.factory import make_rollout_engine, resolve_rollout_dtype
from verl_mega.rollout.partial import PartialRollout
from verl_mega.rollout.trajectory_buffer import UNBOUNDED
from verl_mega.rollout.weight_push import receive_weights, rollout_feed

from ..metrics import StageTimer


def leader(placement: RolePlacement) -> int:
    """The training rank that talks to the rollout ranks."""
    return placement.train_ranks[0]


def replica_leaders(placement: RolePlacement) -> list[int]:
    """The first global rank of each rollout replica: it sends its replica's responses back."""
    return list(placement.rollout_ranks[::placement.rollout_tp])


def replica_messages(placement: RolePlacement, message_for) -> list[tuple[int, tuple]]:
    """(rollout rank, message) for every rollout rank, in rank order: `message_for(replica)` of its replica, so
    the rollout TP ranks of a replica get the same one."""
    return [(rank, message_for(placement.rollout_coordinates(rank).replica)) for rank in placement.rollout_ranks]


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

    def __init__(self, config, bridge: Bridge, placement: RolePlacement):
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
                                          gpu_memory_utilization=config.rollout.gpu_memory_utilization,
                                          quantization=config.rollout.quantization)

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
        """A state the training side checked against the run's bounds before sending it."""
        self.partial.load_state_dict(state, UNBOUNDED)

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
