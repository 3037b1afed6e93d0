"""The batch-stats stage (verl's data metrics under its names) on a four-row step record, against the formulas."""
import pytest
import torch

from verl_mega.config import load_config
from verl_mega.roles.reward import RewardOutput
from verl_mega.trainer.rl.batch_stats import BatchStats
from verl_mega.trainer.rl.step import Step

# Prompts of 2, 3, 1 and 3 tokens (left-padded to 3), responses of 3, 1, 0 and 2 (right-padded to 3).
ATTENTION = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
RESPONSE_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 0, 0]])  # the last row's 2nd token: a tool's


def stage_step(with_values: bool) -> Step:
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    step = Step(0, reward=RewardOutput(scores, torch.zeros(4, 3)))  # the stage reads the sequence scores
    advantages = torch.arange(12, dtype=torch.float32).view(4, 3) - 5
    step.batch = {"attention_mask": ATTENTION, "response_mask": RESPONSE_MASK, "responses": torch.ones(4, 3),
                  "advantages": advantages, "returns": advantages * 2}
    if with_values:
        step.batch["values"] = advantages + torch.tensor([0.5, -0.5, 0.0]).repeat(4, 1)
    return step


def test_lengths_clip_ratios_and_response_token_spreads_follow_verls_formulas():
    config = load_config(None, ["model.hf_path=x", "data.max_prompt_length=3", "data.max_response_length=3"])
    step = stage_step(with_values=False)
    BatchStats(config).run(step)
    metrics = step.metrics
    assert (metrics["response_length/mean"], metrics["response_length/max"], metrics["response_length/min"]) == (
        1.5, 3.0, 0.0)
    assert metrics["response_length/clip_ratio"] == 0.25  # one response reached data.max_response_length
    assert metrics["response/aborted_ratio"] == 0.25  # one is empty
    assert (metrics["prompt_length/mean"], metrics["prompt_length/max"], metrics["prompt_length/min"]) == (
        2.25, 3.0, 1.0)
    assert metrics["prompt_length/clip_ratio"] == 0.5
    assert metrics["critic/score/mean"] == pytest.approx(0.875) and metrics["critic/score/min"] == 0.0
    # advantages over the response mask's tokens only: rows 0 (-5, -4, -3), 1 (-2) and 3 (4).
    assert metrics["critic/advantages/mean"] == pytest.approx(-2.0)
    assert (metrics["critic/advantages/max"], metrics["critic/advantages/min"]) == (4.0, -5.0)
    assert metrics["critic/returns/max"] == 8.0
    assert "critic/values/mean" not in metrics and "critic/vf_explained_var" not in metrics


def test_with_a_critic_the_values_and_their_explained_variance_are_logged():
    step = stage_step(with_values=True)
    BatchStats(load_config(None, ["model.hf_path=x"])).run(step)
    mask = RESPONSE_MASK.bool()
    returns, values = step.batch["returns"][mask], step.batch["values"][mask]
    expected = 1 - (returns - values).var() / (returns.var() + 1e-5)
    assert step.metrics["critic/vf_explained_var"] == pytest.approx(expected.item())
    assert step.metrics["critic/values/mean"] == pytest.approx(values.mean().item())
