"""`make demo-agent-http`: `make demo-agent`'s calculator task learned through the rollout endpoint, by an agent
written against the `openai` client (rollout.multi_turn.agent).

The same tiny model, warm-up, data, reward and GRPO run as `make demo-agent` (verl_mega/demo_agent.py); only the
episodes come another way: each sample is a session of `calculator_agent`, which asks the endpoint for a turn
with the calculator's schema, runs each tool call the model made itself, sends the results back as `tool`
messages and asks again, until the model answers. The endpoint records the sampled ids, so the trajectories are
those the in-process loop would have made.
"""
from __future__ import annotations

import sys

from verl_mega.config import ToolsConfig
from verl_mega.demo_agent import main as demo_agent_main
from verl_mega.tools import ToolCall, ToolSet

AGENT = "verl_mega.demo_agent_http:calculator_agent"


def calculator_agent(messages: list[dict], base_url: str, session_id: str) -> None:
    """One episode: the model's turns from the endpoint, the calculator run here. None: the run's reward
    function scores the episode."""
    import openai  # the agent's framework: needed by this demo only

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    with ToolSet(["calculator"], ToolsConfig()) as tools:
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
