"""The RL step's reporting and scoring stages on small step records in this process: which samples go to
generations.jsonl, the rollout/training mismatch metrics per data source, and DAPO's overlong shaping."""
from types import SimpleNamespace

import pytest
import torch

from verl_mega.config import load_config
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.roles.reward import RewardOutput, RuleReward
from verl_mega.trainer.rl.reporting import Mismatch, SampleLog
from verl_mega.trainer.rl.scoring import Scoring
from verl_mega.trainer.rl.step import Step

MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])


def config(tiny_models, *overrides):
    return load_config(None, [f"model.hf_path={tiny_models['qwen2']}", "rollout.n=2", "data.max_response_length=3",
                              *overrides])


def scoring(tiny_models, settings) -> Scoring:
    return Scoring(settings, RuleReward(load_tokenizer(tiny_models["qwen2"]), "exact_match"), None, 1, print)


def test_the_sample_log_takes_each_prompts_first_sample_first_every_nth_step_on_rank_0(tiny_models):
    settings = config(tiny_models, "trainer.log_samples=3", "trainer.log_samples_every=2")
    logged = []
    step = Step(1, batch={"responses": torch.full((4, 3), 5), "response_mask": MASK, "attention_mask": MASK},
                rows={"raw_prompt": ["a", "a", "b", "b"], "data_source": ["s", "s", None, None]},
                reward=RewardOutput(torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.zeros(4, 3)))
    SampleLog(settings, 0, scoring(tiny_models, settings), lambda n, samples: logged.append((n, samples))).run(step)
    assert [(n, [(s["prompt"], s["score"]) for s in samples]) for n, samples in logged] == [
        (2, [("a", 0.0), ("b", 2.0), ("a", 1.0)])]
    assert logged[0][1][0]["data_source"] == "s" and "data_source" not in logged[0][1][1]
    SampleLog(settings, 1, scoring(tiny_models, settings), lambda *_: logged.append("rank 1")).run(step)
    SampleLog(settings, 0, scoring(tiny_models, settings), lambda *_: logged.append("step 1")).run(Step(0))
    assert len(logged) == 1


def test_the_mismatch_is_measured_on_the_old_log_probs_overall_and_per_source(tiny_models):
    rollout = torch.log(torch.full((4, 3), 0.5))
    train = rollout + torch.tensor([[0.0, 0.2, 0.0], [0.0, 0.0, 0.0], [0.4, 0.0, 0.0], [0.0, 0.0, 0.0]])
    step = Step(0, batch={"old_log_probs": train, "rollout_log_probs": rollout, "response_mask": MASK},
                rows={"data_source": ["x", "x", "y", "y"]})
    no_forward = SimpleNamespace(first_forward_log_probs=None)  # the actor's, where no update ran yet
    Mismatch(config(tiny_models), no_forward).run(step)
    kl = {name: value for name, value in step.metrics.items() if name.startswith("rollout_corr/kl_k1")}
    assert set(kl) == {"rollout_corr/kl_k1", "rollout_corr/kl_k1/x", "rollout_corr/kl_k1/y"}
    assert kl["rollout_corr/kl_k1/x"] != kl["rollout_corr/kl_k1/y"] and kl["rollout_corr/kl_k1"] != 0
    without = Step(0, batch={"old_log_probs": train, "response_mask": MASK}, rows={"data_source": [None] * 4})
    Mismatch(config(tiny_models), no_forward).run(without)
    assert without.metrics == {}  # no rollout log-probs: nothing to compare


def test_overlong_shaping_adds_dapos_penalty_to_the_scores_and_the_last_token(tiny_models):
    settings = config(tiny_models, "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2",
                      "reward.overlong_buffer.penalty_factor=1.0")
    batch = {"response_mask": MASK, "attention_mask": torch.cat([torch.ones(4, 1, dtype=torch.long), MASK], dim=1),
             "responses": torch.ones(4, 3)}
    reward = RewardOutput(torch.zeros(4), torch.zeros(4, 3))
    shaped = scoring(tiny_models, settings).shape_overlong(batch, reward)
    # A 3-token budget with a 2-token buffer pays from 1 token on: -(length - 1) / 2.
    assert shaped.scores.tolist() == pytest.approx([-0.5, -1.0, 0.0, -0.5])
    assert shaped.token_level_rewards[1].tolist() == pytest.approx([0.0, 0.0, -1.0])
