"""The RL step's episodes from the user's agent through the rollout endpoint (`rollout.multi_turn.agent`).

A replica's prompts go to `EndpointRollout.run`, each of their `rollout.n` samples a session of the agent. A
sample the endpoint drops (the agent raised, hung, returned a bad reward or took no turn) leaves its group with
fewer than n samples: its kept samples alone would shift the group's baseline, and nothing may be filled in for
it, so the whole group is generated again, under a seed of its own, up to `ATTEMPTS` times; a group still short
after that stops the run with the last problem named. Every drop is counted (`endpoint/dropped_*`) and its line
goes to the run's log.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

from verl_mega.config import TrainConfig
from verl_mega.config.errors import UserError
from verl_mega.data.prompts import as_messages
from verl_mega.rollout.endpoint import EndpointRollout, load_agent
from verl_mega.rollout.engine import Response, RolloutEngine, SamplingParams

from .step import Note

ATTEMPTS = 3
# A group's later attempts sample this far from the first, above the turns' strides (agent_loop.TURN_SEED_STRIDE).
ATTEMPT_SEED_STRIDE = 2**48
# The metrics that add up over a step's runs; the rest (batch_mean) are the last run's.
SUMMED = ("sessions", "dropped", "limit_ended", "agent_rewards", "engine_calls", "rejected_requests")


def make_agent_endpoint(config: TrainConfig, tokenizer, stop_token_ids: list[int], max_model_len: int
                        ) -> "AgentEndpoint | None":
    """rollout.multi_turn.agent's endpoint, or None where episodes come from the in-process loop (or none)."""
    multi_turn = config.rollout.multi_turn
    if not (multi_turn.enable and multi_turn.agent):
        return None
    try:
        agent = load_agent(multi_turn.agent)
    except ValueError as err:
        raise UserError(f"rollout.multi_turn.agent: {err}") from None
    rollout = EndpointRollout(tokenizer, agent, max_turns=multi_turn.max_turns,
                              budget=multi_turn.max_tokens or config.data.max_response_length,
                              stop_token_ids=stop_token_ids, max_model_len=max_model_len,
                              tool_call_format=multi_turn.tool_call_format, timeout_s=multi_turn.agent_timeout_s,
                              batch_wait_s=multi_turn.agent_batch_wait_s)
    return AgentEndpoint(rollout, multi_turn.agent)


class AgentEndpoint:
    """This replica's episodes through the endpoint, with the metrics and problem lines of the runs since the
    last `drain`."""

    def __init__(self, rollout: EndpointRollout, spec: str):
        self.rollout, self.spec = rollout, spec
        self.counts: Counter = Counter()
        self.last: dict[str, float] = {}
        self.problems: list[str] = []

    def responses(self, engine: RolloutEngine, conversations: list, params: SamplingParams) -> list[Response]:
        """`params.n` episodes per conversation, prompt-major, every group whole (see the module's docstring)."""
        n, messages = params.n, [as_messages(prompt) for prompt in conversations]
        responses: list[Response | None] = [None] * (len(messages) * n)
        todo = list(range(len(messages)))
        for attempt in range(ATTEMPTS):
            seed = None if params.seed is None else params.seed + attempt * ATTEMPT_SEED_STRIDE
            result = self.rollout.run(engine, [messages[i] for i in todo], dataclasses.replace(params, seed=seed))
            self.tally(result.metrics, result.problems)
            short = []
            for position, prompt in enumerate(todo):
                group = result.responses[position * n:(position + 1) * n]
                if any(response is None for response in group):
                    short.append(prompt)
                    continue
                responses[prompt * n:(prompt + 1) * n] = [dataclasses.replace(r, prompt_index=prompt) for r in group]
            todo = short
            if not todo:
                return responses
        raise UserError(f"rollout.multi_turn.agent {self.spec}: prompts {todo} of this replica's share lost a "
                        f"sample in each of {ATTEMPTS} attempts; the last: {self.problems[-1]}")

    def tally(self, metrics: dict[str, float], problems: list[str]) -> None:
        for name, value in metrics.items():
            if name.removeprefix("endpoint/") in SUMMED or name.startswith(("endpoint/dropped_",
                                                                            "endpoint/rejected/")):
                self.counts[name] += value
            else:
                self.last[name] = value
        self.problems.extend(problems)

    def drain(self, note: Note, step_number: int) -> dict[str, float]:
        """The metrics since the last drain; each dropped sample's line noted in the run's log."""
        for line in self.problems:
            note(step_number, f"rollout.multi_turn.agent {self.spec}: dropped {line}")
        metrics = {**self.last, **self.counts}
        self.counts, self.last, self.problems = Counter(), {}, []
        return metrics
