"""`make demo-agent-http`: `make demo-agent`'s calculator task learned through the rollout endpoint, by an agent
written against the `openai` client (rollout.multi_turn.agent).

The same tiny model, warm-up, data, reward and GRPO run as `make demo-agent` (verl_mega/demo_agent.py); only the
episodes come another way: each sample is a session of `calculator_agent`, which asks the endpoint for a turn
with the calculator's schema, runs each tool call the model made itself, sends the results back as `tool`
messages and asks again, until the model answers. The endpoint records the sampled ids, so the trajectories are
those the in-process loop would have made.
"""
from __future__ import annotations

import functools
import sys

from verl_mega.config import ToolsConfig
from verl_mega.demo_agent import main as demo_agent_main
from verl_mega.tools import ToolCall, ToolSet

AGENT = "verl_mega.demo_agent_http:calculator_agent"


@functools.cache
def shared_client():
    """One `openai` client for the process's agents, each a copy of it at its own base_url: a new client
    builds its TLS context, ~70 ms, more than a tiny model's whole episode."""
    import openai  # the agent's framework: needed by this demo only

    return openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", max_retries=0)


@functools.cache
def calculator_tools() -> ToolSet:
    return ToolSet(["calculator"], ToolsConfig())


def calculator_agent(messages: list[dict], base_url: str, session_id: str) -> None:
    """One episode: the model's turns from the endpoint, the calculator run here. None: the run's reward
    function scores the episode."""
    client, tools = shared_client().with_options(base_url=base_url), calculator_tools()
    while True:
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools.schemas)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            result = tools.call(ToolCall(call.function.name, call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.text})


def main(argv=None) -> None:
    """`python -m verl_mega.demo_agent_http [demo-agent's options] [overrides]`."""
    demo_agent_main([*(sys.argv[1:] if argv is None else argv), f"rollout.multi_turn.agent={AGENT}"])


if __name__ == "__main__":
    main()
