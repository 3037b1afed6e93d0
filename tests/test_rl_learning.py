"""The RL step's stages that need no model, each on a small step record in this process: the non-finite guard,
the advantages (with the KL controller and normaliser they own, and their checkpoint keys), the updates' overlong
filtering, when the old-log-prob pass runs, and the step's metrics."""
import pytest
import torch

from verl_mega.algorithms import get_adv_estimator
from verl_mega.config import load_config
from verl_mega.config.errors import NonFiniteError
from verl_mega.roles.reward import RewardOutput, scores_to_token_rewards
from verl_mega.trainer.rl.learning import Advantages, ModelPasses, Updates
from verl_mega.trainer.rl.models import Models
from verl_mega.trainer.rl.reporting import step_metrics
from verl_mega.trainer.rl.step import FiniteOutputs, FiniteReward, NonFiniteGuard, Step


def config(*overrides):
    return load_config(None, ["model.hf_path=x", "rollout.n=2", "critic.enable=false", "algorithm.adv_estimator=grpo",
                              *overrides])


def scored_step(scores, response_mask, **columns) -> Step:
    """A step after sampling: two prompts' groups of len(scores) // 2 rows, the scores on each last token."""
    scores, mask = torch.tensor(scores), torch.tensor(response_mask)
    step = Step(3, reward=RewardOutput(scores, scores_to_token_rewards(scores, mask)))
    step.batch = {"response_mask": mask, "responses": torch.ones_like(mask), "attention_mask": torch.ones_like(mask),
                  **columns}
    step.rows = {"uid": [row // 2 for row in range(len(scores))], "data_source": [None] * len(scores)}
    return step


MASK = [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]


def test_grpo_advantages_are_the_estimators_on_the_steps_scores():
    step = scored_step([1.0, 0.0, 0.5, 2.0], MASK)
    Advantages(config("algorithm.adv_estimator=grpo")).run(step)
    expected, _ = get_adv_estimator("grpo")(step.reward.scores, step.batch["response_mask"].float(),
                                            step.rows["uid"])
    assert torch.equal(step.batch["advantages"], expected.float()) and expected.abs().sum() > 0


def test_remax_advantages_subtract_the_greedy_baseline_on_every_response_token():
    step = scored_step([1.0, 0.0, 0.5, 2.0], MASK)
    step.rows["reward_baseline"] = torch.tensor([0.25, 0.25, 1.0, 1.0])
    Advantages(config("algorithm.adv_estimator=remax")).run(step)
    mask = step.batch["response_mask"].float()
    expected = (step.reward.scores - step.rows["reward_baseline"]).unsqueeze(-1) * mask
    torch.testing.assert_close(step.batch["advantages"], expected)
    assert step.metrics["remax/baseline_mean"] == pytest.approx(0.625)


def test_an_estimator_missing_an_input_names_it():
    with pytest.raises(ValueError, match="takes values, which this step has not computed"):
        Advantages(config("algorithm.adv_estimator=gae")).run(scored_step([1.0, 0.0, 0.5, 2.0], MASK))


def test_the_adaptive_kl_controller_moves_and_its_state_resumes_under_its_keys():
    overrides = ("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.1",
                 "algorithm.normalize_rewards=true")
    log_probs = {"old_log_probs": torch.full((4, 3), -1.0), "ref_log_probs": torch.full((4, 3), -2.0)}
    straight = Advantages(config(*overrides))
    straight.run(scored_step([1.0, 0.0, 0.5, 2.0], MASK, **log_probs))
    state = straight.state_dict()
    assert set(state) == {"kl_ctrl", "reward_normalizer"}  # the keys checkpoints have always held
    assert straight.kl_ctrl.value != 0.1
    resumed = Advantages(config(*overrides))
    resumed.load_state_dict(state)
    steps = [scored_step([0.0, 3.0, 1.0, 1.5], MASK, **log_probs) for _ in range(2)]
    straight.run(steps[0])
    resumed.run(steps[1])
    assert torch.equal(steps[0].batch["advantages"], steps[1].batch["advantages"])
    assert steps[0].metrics == steps[1].metrics and "actor/kl_coef" in steps[0].metrics


def skips() -> tuple[NonFiniteGuard, list]:
    noted = []
    return NonFiniteGuard("skip", lambda number, problem: noted.append((number, problem))), noted


def test_a_nan_reward_ends_the_step_under_skip_and_stops_the_run_under_stop(one_rank_world):
    guard, noted = skips()
    step = scored_step([1.0, float("nan"), 0.5, 2.0], MASK)
    FiniteReward(guard, "reward.function 'f'").run(step)
    assert step.ended and noted == [(4, "the reward is NaN/inf (1 of 4 rows, first row 1: nan); reward.function 'f' "
                                        "must return finite numbers")]
    with pytest.raises(NonFiniteError, match="step 4: the reward is NaN/inf .* nothing saved"):
        FiniteReward(NonFiniteGuard("stop", None), "reward.function 'f'").run(scored_step([float("inf")] * 4, MASK))


def test_finite_outputs_name_the_first_bad_column_and_pass_finite_ones(one_rank_world):
    guard, noted = skips()
    values = torch.zeros(4, 3)
    values[2, 1] = float("inf")
    step = scored_step([1.0, 0.0, 0.5, 2.0], MASK, old_log_probs=torch.zeros(4, 3), values=values)
    FiniteOutputs(guard).run(step)
    assert step.ended and noted[0][1].startswith("the value is NaN/inf (1 of 4 rows, first row 2: inf)")
    clean = scored_step([1.0, 0.0, 0.5, 2.0], MASK, old_log_probs=torch.zeros(4, 3))
    FiniteOutputs(guard).run(clean)
    assert not clean.ended and len(noted) == 1


def test_overlong_filtering_masks_truncated_responses_out_of_the_losses_only():
    batch = {"responses": torch.tensor([[5, 2, 0], [5, 6, 7]]), "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
             "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])}
    filtered = Updates(config("algorithm.overlong_filtering=true"), None, None, [2]).without_overlong(batch)
    assert filtered["response_mask"].tolist() == [[1, 1, 0], [0, 0, 0]]  # the second never reached EOS (2)
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]  # the batch itself is unchanged
    assert Updates(config(), None, None, [2]).without_overlong(batch) is batch


@pytest.mark.parametrize("overrides, needed", [
    ((), False),  # on-policy: the update's first forward has them
    (("actor.ppo_epochs=2",), True),
    (("actor.ppo_epochs=2", "actor.loss.policy_loss=bypass_mode"), False),  # the rollout's are the old ones
    (("algorithm.adv_estimator=optimal_token_baseline",), True),  # the estimator takes them (and sum pi^2)
])
def test_the_old_log_prob_pass_runs_only_where_something_reads_it(overrides, needed):
    settings = config("data.batch_size=4", "actor.mini_batch_size=8", "actor.micro_batch_size=4", *overrides)
    assert ModelPasses(settings, Models(actor=None, actor_ckpt=None)).needs_old_log_probs(8) is needed


def test_a_step_without_a_batch_reports_its_sampling_and_a_trained_one_its_rewards():
    empty = Step(0, metrics={"filter_groups/kept": 0})
    assert step_metrics(empty, 2, {})["trainer/nonfinite_skipped"] == 2
    assert "reward/mean" not in step_metrics(empty, 2, {})
    step = scored_step([1.0, 0.0, 0.5, 2.0], MASK)
    metrics = step_metrics(step, 0, {"weight_push/verified_tensors": 7})
    assert metrics["reward/mean"] == pytest.approx(0.875) and metrics["response/length_max"] == 3
    assert metrics["weight_push/verified_tensors"] == 7
