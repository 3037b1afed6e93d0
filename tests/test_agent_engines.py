"""The agent loop over a real rollout engine: a tiny model that has memorized one calculator episode runs it
under the embedded engine exactly (the tool really called, its result rendered by the template), so every id and
mask of the episode is known; greedy validation decodes it the same way."""
from __future__ import annotations

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tests.agent_chat import memorized_tool_model, two_grpo_steps
from verl_mega.config import ToolsConfig
from verl_mega.rollout.agent_loop import AgentLoop
from verl_mega.rollout.embedded import EmbeddedEngine
from verl_mega.rollout.engine import SamplingParams
from verl_mega.tools import ToolSet

# The fixture trains the tiny model for a few seconds: slow, with the engine runs.
pytestmark = pytest.mark.slow

ROW = {"prompt": [{"role": "user", "content": "tom has 23 boxes of 7 pens. how many pens?"}],
       "reward_model": {"ground_truth": "161"}, "extra_info": {"expression": "23*7"}}


@pytest.fixture(scope="module")
def memorized(tmp_path_factory):
    return memorized_tool_model(tmp_path_factory.mktemp("agent_model") / "hf", ROW)


def embedded_engine(hf) -> EmbeddedEngine:
    from transformers import AutoConfig

    engine = EmbeddedEngine(AutoConfig.from_pretrained(hf).to_dict(), device="cpu")
    engine.load_weights(load_file(str(hf / "model.safetensors")).items())
    return engine


def test_the_embedded_engine_runs_the_memorized_episode_token_for_token(memorized):
    hf, (ids, mask) = memorized
    tokenizer = AutoTokenizer.from_pretrained(hf)
    with ToolSet(["calculator"], ToolsConfig()) as tools:
        loop = AgentLoop(tokenizer, tools, max_turns=3, budget=64, stop_token_ids=[], tool_call_format="hermes")
        (response,) = loop.run(embedded_engine(hf), [ROW["prompt"]],
                               SamplingParams(temperature=0.0, max_new_tokens=64, logprobs=True))
    episode = response.episode
    assert episode.prompt_ids + response.token_ids == ids
    assert [0] * len(episode.prompt_ids) + response.loss_mask == mask
    assert episode.tool_results[0]["ok"] and episode.tool_results[0]["text"] == "161"
    assert [m["content"] for m in episode.messages[1:]] == [
        '<tool_call>{"name":"calculator","arguments":{"expression":"23*7"}}</tool_call>', "161", "161"]
    assert all(lp < 0 for lp, keep in zip(response.logprobs, response.loss_mask) if keep)
    assert all(lp == 0 for lp, keep in zip(response.logprobs, response.loss_mask) if not keep)


def test_a_multi_turn_grpo_run_trains_on_episodes_and_validates_them_greedily(memorized, tmp_path):
    """Two GRPO steps of `make demo-agent`'s recipe on the memorized prompt, one process, the embedded engine:
    the episodes call the calculator, the rollout's log-probs line up with the trainer's on the sampled tokens
    (the template's are masked out of both), and greedy validation replays the memorized episode."""
    import json

    hf, _ = memorized
    records = two_grpo_steps(hf, ROW, tmp_path)
    run_dir = tmp_path / "run"
    trained = [r for r in records if "reward/mean" in r]
    assert len(trained) == 2 and all(r["multi_turn/tool_calls_mean"] > 0 for r in trained), trained
    assert all(0 <= r["multi_turn/tool_success_rate"] <= 1 and r["multi_turn/turns_mean"] >= 1 for r in trained)
    assert all(r["rollout_corr/kl_k3"] < 1e-9 for r in trained), [r["rollout_corr/kl_k3"] for r in trained]
    validation = [r for r in records if "val/reward_mean" in r]
    assert validation and all(r["val/reward/acc"] == 1.0 and r["val/reward/tool_correct"] == 1.0
                              for r in validation), validation
    samples = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert any(message["role"] == "tool" for sample in samples for message in sample["messages"])
