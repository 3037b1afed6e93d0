"""The rollout endpoint's overhead: the same batch of calculator episodes through the in-process agent loop and
through the endpoint (an `openai` agent per sample, real HTTP), on the embedded engine, CPU.

    OMP_NUM_THREADS=1 python -m bench.agent_endpoint_overhead [--batch 32] [--repeats 3] [--hidden-size 64]
    OMP_NUM_THREADS=1 python -m bench.agent_endpoint_overhead --body llama100m --warmup-steps 0

A tiny model is warmed up on `make demo-agent`'s formatted episodes (so its episodes call the calculator, two
turns each; with `--warmup-steps 0` the random model writes no call, and each episode is one turn to the budget:
with `--body llama100m`, a turn of a real model's length), then each way runs `--repeats` times under the same
seed; the fastest of each is compared. The episodes must be the same token for token (checked), so both ways decode the same tokens in the same rounds and
the difference is the endpoint's: HTTP, JSON, the chat template on the agent's messages, the agents' threads.
Goal: endpoint / in-process <= 1.2 at the same batch. A tiny model makes the engine's share small and the
ratio the worst case; measure on an idle machine (other processes inflate the agents' threads most). The last
line is the floor: the agent's `openai` client and HTTP alone, against a server answering at once.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file
from transformers import AutoConfig

from verl_mega.config import ToolsConfig
from verl_mega.demo_agent import problems, save_tokenizer, sft_warmup
from verl_mega.demo_agent_http import calculator_agent, shared_client
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.rollout.agent_loop import AgentLoop, ChatRenderer
from verl_mega.rollout.embedded import EmbeddedEngine
from verl_mega.rollout.endpoint import EndpointRollout
from verl_mega.rollout.endpoint.server import EndpointServer
from verl_mega.rollout.engine import SamplingParams
from verl_mega.tools import ToolSet

BUDGET, MAX_TURNS = 96, 3
# The model's body: tiny (--hidden-size), or bench.vs_trl's ~100M Llama shape (its vocabulary the tiny one's).
BODIES = {"tiny": {}, "llama100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                        num_attention_heads=12, num_key_value_heads=4)}
CANNED = {"id": "canned", "object": "chat.completion", "created": 0, "model": "policy",
          "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "5"}}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class TimedEngine:
    """The engine, with the seconds spent in `generate` summed."""

    def __init__(self, engine: EmbeddedEngine):
        self.engine, self.seconds = engine, 0.0

    def generate(self, prompts, params):
        start = time.perf_counter()
        try:
            return self.engine.generate(prompts, params)
        finally:
            self.seconds += time.perf_counter() - start


def warm_model(workdir: Path, body: str, hidden_size: int, warmup_steps: int) -> Path:
    """The model the episodes run on: warmed up on formatted episodes for `warmup_steps` (0: its random weights,
    which write no calls, so each episode is one turn to the budget)."""
    sizes = BODIES[body] or dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size)
    hf = make_tiny_hf_model(workdir / "random", "qwen2", vocab_size=72, **sizes)
    tokenizer = save_tokenizer(hf)
    if warmup_steps == 0:
        return hf
    with ToolSet(["calculator"], ToolsConfig()) as tools:
        return sft_warmup(hf, ChatRenderer(tokenizer, tools.schemas), problems(512, "warmup"), workdir / "warm",
                          warmup_steps)


def timed(label: str, run, engine: TimedEngine, repeats: int):
    """(responses, fastest wall seconds, the engine's seconds in that run)."""
    best = None
    for _ in range(repeats):
        engine.seconds = 0.0
        start = time.perf_counter()
        responses = run()
        wall = time.perf_counter() - start
        if best is None or wall < best[1]:
            best = (responses, wall, engine.seconds)
    print(f"{label:>11}: {best[1]:.3f} s wall, {best[2]:.3f} s in engine.generate (fastest of {repeats})",
          flush=True)
    return best


def http_floor_ms(requests: int = 300) -> float:
    """Milliseconds per request of the demo agent's own `openai` client against the endpoint's HTTP server
    answering a canned completion at once, one request after another: what HTTP and the client cost a turn
    before any session, template or engine work (the floor of the endpoint's own time)."""
    server = EndpointServer(lambda method, path, body: (200, CANNED), lambda code: None).start()
    try:
        client = shared_client().with_options(base_url=f"{server.url}/v1")
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        for _ in range(20):
            client.chat.completions.create(model="policy", messages=messages)
        start = time.perf_counter()
        for _ in range(requests):
            client.chat.completions.create(model="policy", messages=messages)
        return (time.perf_counter() - start) / requests * 1e3
    finally:
        server.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench.agent_endpoint_overhead")
    parser.add_argument("--batch", type=int, default=32, help="episodes per rollout (prompts x n)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--body", choices=list(BODIES), default="tiny", help="the model's shape (see BODIES)")
    parser.add_argument("--hidden-size", type=int, default=64, help="the tiny body's width")
    parser.add_argument("--warmup-steps", type=int, default=150)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        hf = warm_model(Path(tmp), args.body, args.hidden_size, args.warmup_steps)
        tokenizer = save_tokenizer(hf)
        engine = EmbeddedEngine(AutoConfig.from_pretrained(hf).to_dict(), device="cpu")
        engine.load_weights(load_file(str(hf / "model.safetensors")).items())
    timed_engine = TimedEngine(engine)
    conversations = [row["prompt"] for row in problems(args.batch // args.n, "heldout")]
    params = SamplingParams(temperature=0.7, max_new_tokens=BUDGET, n=args.n, seed=5, logprobs=True)
    with ToolSet(["calculator"], ToolsConfig()) as tools:
        loop = AgentLoop(tokenizer, tools, max_turns=MAX_TURNS, budget=BUDGET, stop_token_ids=[],
                         tool_call_format="hermes")
        local, local_wall, local_engine = timed("in-process", lambda: loop.run(timed_engine, conversations, params),
                                                timed_engine, args.repeats)
    rollout = EndpointRollout(tokenizer, calculator_agent, max_turns=MAX_TURNS, budget=BUDGET, stop_token_ids=[],
                              max_model_len=512, tool_call_format="hermes")
    served, served_wall, served_engine = timed(
        "endpoint", lambda: rollout.run(timed_engine, conversations, params).responses, timed_engine, args.repeats)
    same = [a.token_ids for a in local] == [b.token_ids if b is not None else None for b in served]
    turns = sum(len(r.episode.turn_ends) for r in local) / len(local)
    print(f"batch {len(local)} episodes, {turns:.2f} turns each; the same trajectories token for token: {same}")
    if not same:  # e.g. a call written as malformed JSON, which the loop and the demo's agent answer differently
        raise SystemExit("the two ways sampled different episodes, so their times are not of the same work: no "
                         "ratio (try more --warmup-steps, or another --hidden-size)")
    print(f"endpoint / in-process wall time: {served_wall / local_wall:.2f}x (goal <= 1.2x); engine time "
          f"{served_engine:.3f} s vs {local_engine:.3f} s; the endpoint's own time {served_wall - served_engine:.3f} s "
          f"vs the loop's {local_wall - local_engine:.3f} s")
    requests, floor = round(turns * len(local)), http_floor_ms()
    print(f"the floor: the openai client and HTTP alone take {floor:.2f} ms per request against a server answering "
          f"at once, {requests * floor / 1e3:.3f} s for this run's {requests} requests; with nothing else the "
          f"ratio would be {(local_wall + requests * floor / 1e3) / local_wall:.2f}x")


if __name__ == "__main__":
    main()
