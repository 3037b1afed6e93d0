"""The rollout client of the RL step: the rollout engine's awake window and the HybridEngine transition into it,
the replicas' generation (single turns, or multi-turn episodes through the agent loop), and the sampling
parameters and seeds of each slot (step, round).

Colocated, the engine runs on the training ranks: each replica generates its share and every rank gets all the
responses. With rollout ranks of their own (disaggregated), `remote` pushes the weights to them and asks them.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, ContextManager, Iterable

import torch
import torch.distributed as dist

from verl_mega.config import TrainConfig
from verl_mega.config.errors import UserError
from verl_mega.data.prompts import as_messages
from verl_mega.models.builder import DTYPES
from verl_mega.parallel.bridge import Bridge
from verl_mega.parallel.layout import ParallelLayout, RolePlacement, RolloutCoordinates, rollout_coordinates
from verl_mega.rollout.agent_loop import AgentLoop
from verl_mega.rollout.embedded import EmbeddedEngine
from verl_mega.rollout.engine import Response, RolloutEngine, SamplingParams
from verl_mega.rollout.factory import make_rollout_engine, resolve_rollout_dtype
from verl_mega.rollout.hybrid_engine import HybridEngine
from verl_mega.rollout.quantization_probe import probe_first_load
from verl_mega.rollout.training_memory import models_memory_released
from verl_mega.tools import ToolSet

from ..metrics import StageTimer
from .agent_endpoint import AgentEndpoint, make_agent_endpoint
from .models import Models
from .remote import RemoteRollout

# Seeds of a step's later generation rounds (dynamic sampling) sit this far apart, above any step's first-round
# seed: each (step, round, replica) samples its own stream, the same on resume.
ROUND_SEED_STRIDE = 2**31


def rollout_seed(base: int, step: int, gen_round: int, replicas: int, replica: int) -> int:
    """The sampling seed of a replica's generation round in a step (0-based step and round): a pure function of
    them, so a resumed run draws what the uninterrupted one drew; round 0 keeps the seeds runs had before
    dynamic sampling."""
    return base + step * replicas + replica + gen_round * ROUND_SEED_STRIDE


def eos_token_ids(hf_config_raw: dict, tokenizer) -> list[int]:
    """The tokens a response stops at: the model config's EOS ids (the engines stop there) and the tokenizer's."""
    eos = hf_config_raw.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return sorted(set(ids) | ({tokenizer.eos_token_id} - {None}))


def make_agent_loop(config: TrainConfig, tokenizer, stop_token_ids: list[int]) -> AgentLoop | None:
    """rollout.multi_turn's agent loop over its tools, or None for single-turn rollouts and the user's agent
    (rollout.multi_turn.agent: `make_agent_endpoint`)."""
    multi_turn, data = config.rollout.multi_turn, config.data
    if not multi_turn.enable or multi_turn.agent:
        return None
    return AgentLoop(tokenizer, ToolSet(multi_turn.tools, config.tools), max_turns=multi_turn.max_turns,
                     budget=multi_turn.max_tokens or data.max_response_length, stop_token_ids=stop_token_ids,
                     tool_call_format=multi_turn.tool_call_format)


class Generation:
    """What the step and validation generate with. `engine` (colocated) or `remote` (rollout ranks of their own);
    `weights()` streams the actor's current weights in the rollout layout; `training_memory()` releases the
    training side's memory for as long as the engine is awake, and yields what releases the parameters once the
    engine has loaded its copy (`rollout.training_memory`). Episodes come from `agent` (the in-process loop) or
    `endpoint` (the user's agent through the rollout endpoint), or neither (single turns)."""

    def __init__(self, config: TrainConfig, layout: ParallelLayout, engine: RolloutEngine | None,
                 remote: RemoteRollout | None, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                 training_memory: Callable[[], ContextManager], agent: AgentLoop | None, eos_ids: list[int],
                 records_routing: bool = False, probe: Callable[[], float] | None = None,
                 endpoint: AgentEndpoint | None = None):
        """`probe`: run once after the first transition (the int8 rollout's check, `quantization_probe`)."""
        self.config, self.layout = config, layout
        self.probe = probe
        self.engine, self.remote, self.weights, self.training_memory = engine, remote, weights, training_memory
        self.agent, self.eos_token_ids, self.records_routing = agent, eos_ids, records_routing
        self.endpoint = endpoint

    @classmethod
    def build(cls, config: TrainConfig, layout: ParallelLayout, tokenizer, hf_config, family, models: Models,
              bridge: Bridge | None = None, placement: RolePlacement | None = None) -> "Generation":
        """The HybridEngine over the actor and the rollout engine behind it, or the client of the rollout ranks."""
        actor, idle = models.actor, models.idle_in_rollout(config)
        rollout_dtype = DTYPES[resolve_rollout_dtype(config.rollout.engine, config.rollout.dtype, config.model.dtype)]
        hybrid = HybridEngine(actor.model, hf_config, family, config.parallel.rollout_tp, dtype=rollout_dtype,
                              quantization=config.rollout.quantization)
        eos_ids = eos_token_ids(hf_config.raw, tokenizer)
        agent = make_agent_loop(config, tokenizer, eos_ids)
        # A multi-turn turn may ask for the longest budget left in its batch on top of a context of up to the
        # prompt and a whole budget: the engine's context limit holds both.
        episodes = config.rollout.multi_turn.enable
        responses = config.data.max_response_length * (2 if episodes else 1)
        engine = remote = None
        if placement is not None and placement.disaggregated:
            remote = RemoteRollout(bridge, placement, hybrid, config.parallel.weight_push_bucket_mb,
                                   config.parallel.weight_push_verify)
        else:
            engine = make_rollout_engine(config.rollout.engine, config.model.hf_path, hf_config.raw, hybrid.feed,
                                         max_model_len=config.data.max_prompt_length + responses, dtype=rollout_dtype,
                                         gpu_memory_utilization=config.rollout.gpu_memory_utilization,
                                         quantization=config.rollout.quantization)
        # An MoE model's rollout routing, where the engine can record it: replayed (actor.router_replay), and
        # compared with the trainer's own either way (actor/router_mismatch). The trajectory buffer of the other
        # rollout modes holds none.
        records_routing = (hf_config.num_experts is not None and engine is not None and engine.records_routing
                           and config.rollout.mode == "sync")
        if config.actor.router_replay == "rollout" and not records_routing:
            raise UserError(f"actor.router_replay=rollout: the {type(engine).__name__} rollout engine cannot "
                            "return the experts it routed each token to; set rollout.engine=embedded or "
                            "actor.router_replay=off")
        if isinstance(engine, EmbeddedEngine) and config.rollout.quantization == "int8":
            def probe() -> float:  # the training weights at the first transition, unquantized
                return probe_first_load(engine, hf_config.raw, hybrid.stream(quantized=False), rollout_dtype)
        else:
            probe = None
        endpoint = make_agent_endpoint(config, tokenizer, eos_ids, config.data.max_prompt_length + responses)
        return cls(config, layout, engine, remote, hybrid.stream,
                   lambda: models_memory_released(idle), agent, eos_ids, records_routing, probe, endpoint)

    @property
    def replicas(self) -> int:
        if self.remote is not None:
            return self.remote.replicas
        return self.rollout_coordinates().replicas

    def rollout_coordinates(self) -> RolloutCoordinates:
        """This rank's rollout replica among the training ranks (colocated)."""
        layout = self.layout
        return rollout_coordinates(layout.rank, layout.world_size, layout.tp, self.config.parallel.rollout_tp)

    @contextlib.contextmanager
    def awake(self, timer: StageTimer, version: int):
        """The rollout engine with the actor's current weights (after `version` optimizer steps) and its KV cache,
        for the body; the training side's memory (gradient buffers, optimizer state, allocator cache) is released
        before the engine wakes, so the KV cache is not allocated on top of it, and comes back after it sleeps."""
        if self.remote is not None:  # the rollout ranks' engines: the current weights pushed to them
            if self.remote.version != version:
                with timer("transition"):
                    self.remote.push(version)
            yield
            return
        with self.training_memory() as release_params:
            with timer("transition"):
                self.engine.wake_up(["weights"])
                self.engine.load_weights(self.weights())
            # Outside the transition's time, once per process; it reads the training weights, so before they go.
            if self.probe is not None:
                self.probe()
                self.probe = None
            with timer("transition"):
                release_params()  # the engine holds its copy now
                self.engine.wake_up(["kv_cache"])
            yield
            with timer("transition"):
                self.engine.sleep()

    def sampling_params(self, step: int, gen_round: int, replicas: int, replica: int) -> SamplingParams:
        """The rollout's sampling (rollout.*, n per prompt) for a replica, seeded by the slot (step, gen_round)."""
        rollout = self.config.rollout
        return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                              max_new_tokens=self.config.data.max_response_length, n=rollout.n, logprobs=True,
                              routed_experts=self.records_routing,
                              seed=rollout_seed(rollout.seed, step, gen_round, replicas, replica))

    def round_seeds(self, replicas: int, step: int, gen_round: int) -> list[int]:
        """Each replica's sampling seed of slot (step, gen_round), as a whole-round generation has it."""
        return [self.sampling_params(step, gen_round, replicas, replica).seed for replica in range(replicas)]

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, step: int = 0,
                 gen_round: int = 0, conversations: list | None = None) -> list[Response]:
        """Collective: each rollout replica generates its share of the prompts; every rank gets all responses,
        each with its tokens' log-probs under the distribution they were sampled from (the engine's own, at no
        extra pass). `params`: the rollout's sampling seeded by the slot (`step`, `gen_round`) unless given.
        `conversations`: the prompts as the data gives them, which multi-turn episodes start from."""
        coordinates = self.rollout_coordinates()
        replicas, replica = coordinates.replicas, coordinates.replica
        share = len(prompts) // replicas
        mine = prompts[replica * share:(replica + 1) * share]
        params = params or self.sampling_params(step, gen_round, replicas, replica)
        mine_conversations = None if conversations is None else conversations[replica * share:(replica + 1) * share]
        responses = [dataclasses.replace(r, prompt_index=replica * share + r.prompt_index)
                     for r in self.responses(mine, mine_conversations, params)] if mine else []
        gathered: list = [None] * self.layout.world_size
        dist.all_gather_object(gathered, (replica, coordinates.leads_replica, responses))
        by_replica = {rep: resp for rep, is_leader, resp in gathered if is_leader}
        return [response for rep in range(replicas) for response in by_replica[rep]]

    def responses(self, prompts: list[list[int]], conversations: list | None, params: SamplingParams
                  ) -> list[Response]:
        """This replica's responses: multi-turn episodes through the agent loop or the user's agent where one
        runs (from the conversations), else the engine's single turns."""
        if self.endpoint is not None:
            return self.endpoint.responses(self.engine, conversations, params)
        if self.agent is None:
            return self.engine.generate(prompts, params)
        return self.agent.run(self.engine, [as_messages(prompt) for prompt in conversations], params)

    def push_metrics(self) -> dict[str, int]:
        """With parallel.weight_push_verify: how many tensors of the last push to the rollout ranks had the same
        checksum on both sides (every one, or the push would have stopped the run)."""
        if self.remote is None or not self.remote.verify:
            return {}
        return {"weight_push/verified_tensors": self.remote.verified_tensors}

    def close(self) -> None:
        (self.engine or self.remote).close()
        if self.agent is not None:
            self.agent.toolset.close()
