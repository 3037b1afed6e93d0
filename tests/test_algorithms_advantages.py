"""Advantage estimators: GAE (via verl_mega.ops), GRPO, Dr. GRPO, RLOO, REINFORCE++ (+ baseline), ReMax, OPO,
GRPO pass@k, GPG and the optimal token baseline (plain and TIR), each against numbers worked out by hand."""

import math

import pytest
import torch

from verl_mega.algorithms import estimator_inputs, estimator_knobs
from verl_mega.algorithms.advantages import get_adv_estimator

FULL_MASK = torch.ones(6, 2)


def test_grpo_group_of_identical_scores_has_zero_advantage():
    scores = torch.tensor([0.7, 0.7, 0.7])
    advantages, returns = get_adv_estimator("grpo")(scores, torch.ones(3, 4), ["p", "p", "p"])
    assert torch.equal(advantages, torch.zeros(3, 4))
    assert torch.equal(returns, advantages)


def test_grpo_normalises_within_each_prompt_group():
    # group a: [1, 0], mean 0.5, unbiased std sqrt(0.5)  -> +-0.5 / sqrt(0.5) = +-sqrt(0.5)
    # group b: [1, 0.5, 0], mean 0.5, unbiased std 0.5   -> [1, 0, -1]
    # group c: a single response: mean 0, std 1           -> 0.3
    scores = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.0, 0.3])
    index = ["a", "b", "a", "b", "b", "c"]
    advantages, _ = get_adv_estimator("grpo")(scores, FULL_MASK, index)
    expected = torch.tensor([0.5**0.5, 1.0, -(0.5**0.5), 0.0, -1.0, 0.3])
    torch.testing.assert_close(advantages[:, 0], expected, atol=1e-5, rtol=1e-5)
    # a tensor of uids groups the same way as a list of strings
    tensor_index = torch.tensor([10, 20, 10, 20, 20, 30])
    torch.testing.assert_close(get_adv_estimator("grpo")(scores, FULL_MASK, tensor_index)[0], advantages)


def test_dr_grpo_subtracts_group_mean_without_std_division():
    scores = torch.tensor([1.0, 0.5, 0.0])
    advantages, _ = get_adv_estimator("dr_grpo")(scores, torch.ones(3, 1), ["b", "b", "b"])
    # mean 0.5 -> [0.5, 0, -0.5]
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.5, 0.0, -0.5]))


def test_outcome_advantage_is_zero_past_each_response():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages, _ = get_adv_estimator("grpo")(torch.tensor([1.0, 0.0]), mask, ["a", "a"])
    assert torch.equal(advantages == 0, mask == 0)


def test_rloo_uses_mean_of_the_other_responses_as_baseline():
    # group [1, 0, 0.5]: 1 - (0 + 0.5)/2 = 0.75, 0 - (1 + 0.5)/2 = -0.75, 0.5 - (1 + 0)/2 = 0
    # a lone response keeps its score (no baseline): 0.4
    scores = torch.tensor([1.0, 0.0, 0.5, 0.4])
    advantages, returns = get_adv_estimator("rloo")(scores, torch.ones(4, 2), ["g", "g", "g", "solo"])
    torch.testing.assert_close(advantages[:, 1], torch.tensor([0.75, -0.75, 0.0, 0.4]))
    assert torch.equal(returns, advantages)


def test_reinforce_plus_plus_discounts_then_whitens():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = get_adv_estimator("reinforce_plus_plus")(rewards, mask, gamma=0.5)
    # return-to-go G_t = r_t + 0.5 G_{t+1}: row 0 -> [0.25, 0.5, 1], row 1 -> [1, 2, (pad) 0]
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    # whitened over the 5 response tokens: mean 4.75 / 5 = 0.95, unbiased var = sum((G - 0.95)^2) / 4
    on_mask = [0.25, 0.5, 1.0, 1.0, 2.0]
    std = (sum((g - 0.95) ** 2 for g in on_mask) / 4) ** 0.5
    expected = torch.tensor([[(g - 0.95) / std for g in on_mask[:3]], [(g - 0.95) / std for g in on_mask[3:]] + [0.0]])
    torch.testing.assert_close(advantages, expected)


def test_reinforce_plus_plus_return_is_cut_at_a_masked_out_token():
    # gamma 1, token 1 masked (an observation): G_2 = 1, G_1 = 0 + 1 then cut, so G_0 = 0
    rewards, mask = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[1.0, 0.0, 1.0]])
    _, returns = get_adv_estimator("reinforce_plus_plus")(rewards, mask)
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.0, 1.0]]))


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens():
    # group means: [1, 0] -> 0.5, lone 1 -> no baseline; centred scores [0.5, -0.5, 1] on 2 tokens each
    advantages, _ = get_adv_estimator("reinforce_plus_plus_baseline")(
        torch.tensor([1.0, 0.0, 1.0]), torch.ones(3, 2), ["a", "a", "solo"]
    )
    centred = torch.tensor([0.5, 0.5, -0.5, -0.5, 1.0, 1.0])
    # whitening: (x - mean) / unbiased std over the 6 tokens
    expected = (centred - centred.mean()) / centred.std()
    torch.testing.assert_close(advantages.flatten(), expected)


def test_outcome_estimators_reject_bad_shapes_naming_the_argument():
    with pytest.raises(ValueError, match="scores"):
        get_adv_estimator("grpo")(torch.zeros(3), torch.ones(2, 4), ["a", "a"])
    with pytest.raises(ValueError, match="index"):
        get_adv_estimator("rloo")(torch.zeros(2), torch.ones(2, 4), ["a"])
    with pytest.raises(ValueError, match="response_mask"):
        get_adv_estimator("reinforce_plus_plus")(torch.zeros(2, 4), torch.ones(2, 3))


def test_gae_hand_computed():
    # An empty verl_mega/ops folder imports as a namespace package, so look for the function itself.
    if not hasattr(pytest.importorskip("verl_mega.ops"), "gae"):
        pytest.skip("verl_mega.ops.gae is not available yet")
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    mask = torch.ones(1, 3)
    # gamma 1, lam 0.5: delta = r_t + V_{t+1} - V_t = [0, 0, 0.5] (V after the end is 0)
    # A_t = delta_t + 0.5 A_{t+1} = [0.125, 0.25, 0.5]; returns = A + V
    advantages, returns = get_adv_estimator("gae")(rewards, values, mask, gamma=1.0, lam=0.5, whiten=False)
    torch.testing.assert_close(advantages, torch.tensor([[0.125, 0.25, 0.5]]))
    torch.testing.assert_close(returns, torch.tensor([[0.625, 0.75, 1.0]]))
    whitened, _ = get_adv_estimator("gae")(rewards, values, mask, gamma=1.0, lam=0.5)
    expected = (advantages - advantages.mean()) / advantages.std()
    torch.testing.assert_close(whitened, expected, atol=1e-5, rtol=1e-5)


def test_every_estimator_names_its_inputs_from_the_trainers_vocabulary():
    vocabulary = {"token_level_rewards", "scores", "response_mask", "index", "values", "reward_baselines",
                  "old_log_probs", "sum_pi_squared", "rollout_log_probs"}
    from verl_mega.algorithms import ADV_ESTIMATORS
    for name in ADV_ESTIMATORS.names():
        assert set(estimator_inputs(name)) <= vocabulary, name
    assert estimator_inputs("remax") == ("token_level_rewards", "reward_baselines", "response_mask")
    assert "rollout_log_probs" in estimator_inputs("tir_optimal_token_baseline")
    # Dr. GRPO is GRPO without the std division whatever algorithm.norm_adv_by_std_in_grpo says
    assert estimator_knobs("dr_grpo") == ()
    assert "norm_adv_by_std_in_grpo" in estimator_knobs("grpo_passk")


def test_remax_subtracts_the_greedy_score_from_the_return_on_each_token():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0], [-0.1, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    baselines = torch.tensor([0.4, 1.0, 0.5])
    advantages, returns = get_adv_estimator("remax")(rewards, baselines, mask)
    # returns: reward-to-go [1, 1, 1], [0.5, 0.5, pad], [0.9, 1, 1] (a per-token KL term enters the return)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0], [0.9, 1.0, 1.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.6, 0.6, 0.6], [-0.5, -0.5, 0.0], [0.4, 0.5, 0.5]]))


def test_remax_all_masked_row_has_zero_advantage():
    advantages, _ = get_adv_estimator("remax")(torch.zeros(1, 3), torch.tensor([0.7]), torch.zeros(1, 3))
    assert torch.equal(advantages, torch.zeros(1, 3))


def test_opo_baseline_is_the_length_weighted_group_mean():
    # group a: scores [1, 0], lengths [3, 1] -> baseline (3 * 1 + 1 * 0) / 4 = 0.75 -> [0.25, -0.75]
    # a lone response has baseline 0: 0.4
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    advantages, returns = get_adv_estimator("opo")(torch.tensor([1.0, 0.0, 0.4]), mask, ["a", "a", "solo"])
    torch.testing.assert_close(advantages, torch.tensor([[0.25, 0.25, 0.25], [-0.75, 0.0, 0.0], [0.4, 0.4, 0.0]]))
    assert torch.equal(returns, advantages)


def test_opo_group_of_empty_responses_stays_finite():
    advantages, _ = get_adv_estimator("opo")(torch.tensor([1.0, 0.0]), torch.zeros(2, 3), ["a", "a"])
    assert torch.equal(advantages, torch.zeros(2, 3))


def test_grpo_passk_rewards_only_each_groups_best_by_its_lead():
    # group a: [1, 0.5, 0]: lead 1 - 0.5 = 0.5, unbiased std 0.5 -> 1 on the best, 0 elsewhere
    # group b: [0.2, 0.6]: lead 0.4, std sqrt(0.08) -> 0.4 / sqrt(0.08) on the second
    scores = torch.tensor([0.5, 1.0, 0.2, 0.0, 0.6])
    index = ["a", "a", "b", "a", "b"]
    advantages, _ = get_adv_estimator("grpo_passk")(scores, torch.ones(5, 2), index)
    expected = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.4 / math.sqrt(0.08)])
    torch.testing.assert_close(advantages[:, 0], expected, atol=1e-5, rtol=1e-5)
    unnormalised, _ = get_adv_estimator("grpo_passk")(scores, torch.ones(5, 2), index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(unnormalised[:, 1], torch.tensor([0.0, 0.5, 0.0, 0.0, 0.4]))


def test_grpo_passk_tie_for_the_best_gives_the_group_nothing():
    advantages, _ = get_adv_estimator("grpo_passk")(torch.tensor([1.0, 0.0, 1.0]), torch.ones(3, 2), ["g"] * 3)
    assert torch.equal(advantages, torch.zeros(3, 2))


def test_grpo_passk_refuses_a_singleton_group():
    with pytest.raises(ValueError, match="at least 2 responses per prompt.*rollout.n"):
        get_adv_estimator("grpo_passk")(torch.tensor([1.0, 0.0, 1.0]), torch.ones(3, 2), ["g", "g", "solo"])


def test_gpg_scales_the_centred_score_by_batch_over_rewarded():
    # B = 4 responses, M = 1 with a non-zero score -> alpha 4; group means a 0.5, b 0
    advantages, _ = get_adv_estimator("gpg")(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.ones(4, 2), list("aabb"))
    torch.testing.assert_close(advantages[:, 0], torch.tensor([2.0, -2.0, 0.0, 0.0]))
    # B = 3, M = 2 -> alpha 1.5; a lone response keeps its score: 1.5 * 0.5
    advantages, _ = get_adv_estimator("gpg")(torch.tensor([1.0, 0.0, 0.5]), torch.ones(3, 1), ["a", "a", "solo"])
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.75, -0.75, 0.75]))


def test_gpg_batch_without_any_reward_has_zero_advantage():
    advantages, _ = get_adv_estimator("gpg")(torch.zeros(4), torch.ones(4, 2), list("aabb"))
    assert torch.equal(advantages, torch.zeros(4, 2))


def _otb_group():
    """Two responses to one prompt: row 0 scores 0 over 2 tokens with pi = 0.5 and sum pi^2 = 0.5 (w = 0.5),
    row 1 scores 1 over 3 tokens with pi = 0.25 and sum pi^2 = 0.5 (w = 1)."""
    rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old_log_probs = torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 0.25]]).log()
    sum_pi_squared = torch.full((2, 3), 0.5)
    return rewards, mask, old_log_probs, sum_pi_squared


def test_optimal_token_baseline_weights_each_position_by_the_cumulative_energy():
    rewards, mask, old_log_probs, sum_pi_squared = _otb_group()
    advantages, returns = get_adv_estimator("optimal_token_baseline")(rewards, mask, ["p", "p"], old_log_probs,
                                                                      sum_pi_squared)
    # G: [0, 0], [1, 1, 1]; W: [0.5, 1], [1, 2, 3]
    # B_0 = (0 * 0.5 + 1 * 1) / 1.5 = 2/3, B_1 = (0 * 1 + 1 * 2) / 3 = 2/3, B_2 = 1 * 3 / 3 = 1 (row 1 alone)
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[-2 / 3, -2 / 3, 0.0], [1 / 3, 1 / 3, 0.0]]))
    # with handle_zero_tail, the longest response's baseline past the runner-up's length is 0
    tail, _ = get_adv_estimator("optimal_token_baseline")(rewards, mask, ["p", "p"], old_log_probs, sum_pi_squared,
                                                          handle_zero_tail=True)
    torch.testing.assert_close(tail[1], torch.tensor([1 / 3, 1 / 3, 1.0]))


def test_optimal_token_baseline_singleton_and_empty_rows():
    rewards, mask, old_log_probs, sum_pi_squared = _otb_group()
    # the same two rows as separate prompts, plus an all-masked copy of row 0 in its group: no baseline anywhere
    empty_mask = torch.cat([mask, torch.zeros(1, 3)])
    advantages, returns = get_adv_estimator("optimal_token_baseline")(
        torch.cat([rewards, rewards[:1]]), empty_mask, ["a", "b", "a"], torch.cat([old_log_probs, old_log_probs[:1]]),
        torch.cat([sum_pi_squared, sum_pi_squared[:1]]))
    torch.testing.assert_close(advantages, returns * empty_mask)
    assert torch.equal(advantages[2], torch.zeros(3))


def test_tir_optimal_token_baseline_equals_otb_with_zero_tail_when_rollout_matches():
    rewards, mask, old_log_probs, sum_pi_squared = _otb_group()
    tir, _ = get_adv_estimator("tir_optimal_token_baseline")(rewards, mask, ["p", "p"], old_log_probs, sum_pi_squared,
                                                             old_log_probs)
    torch.testing.assert_close(tir, torch.tensor([[-2 / 3, -2 / 3, 0.0], [1 / 3, 1 / 3, 1.0]]))


def test_tir_optimal_token_baseline_scales_energy_by_the_squared_truncated_ratio():
    rewards, mask, old_log_probs, sum_pi_squared = _otb_group()
    # row 0: pi_train / pi_rollout = 10, capped at 2 -> w = 0.5 * 4 = 2, W = [2, 4]; row 1 unchanged
    rollout_log_probs = old_log_probs - torch.tensor([[math.log(10.0)] * 3, [0.0] * 3])
    tir, _ = get_adv_estimator("tir_optimal_token_baseline")(rewards, mask, ["p", "p"], old_log_probs, sum_pi_squared,
                                                             rollout_log_probs, tir_is_threshold=2.0)
    # B_0 = (0 + 1 * 1) / (2 + 1) = 1/3, B_1 = (0 + 1 * 2) / (4 + 2) = 1/3; row 1's tail past 2 tokens: 0
    torch.testing.assert_close(tir, torch.tensor([[-1 / 3, -1 / 3, 0.0], [2 / 3, 2 / 3, 1.0]]))


def _observation_after_first_token(values):
    """[2, 3] -> [2, 4]: row 1 gets a zero column after its first token (a tool observation), row 0 a padding one."""
    padded = torch.cat([values[0], torch.zeros(1)])
    spread = torch.cat([values[1, :1], torch.zeros(1), values[1, 1:]])
    return torch.stack([padded, spread])


def test_tir_optimal_token_baseline_aligns_tokens_by_count_across_masked_observations():
    rewards, mask, old_log_probs, sum_pi_squared = _otb_group()
    contiguous, _ = get_adv_estimator("tir_optimal_token_baseline")(rewards, mask, ["p", "p"], old_log_probs,
                                                                    sum_pi_squared, old_log_probs)
    # row 1's second token moved past a masked-out observation: the same tokens, the same advantages
    spread_mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    moved, _ = get_adv_estimator("tir_optimal_token_baseline")(
        _observation_after_first_token(rewards), spread_mask, ["p", "p"], _observation_after_first_token(old_log_probs),
        _observation_after_first_token(sum_pi_squared), _observation_after_first_token(old_log_probs))
    torch.testing.assert_close(moved[1][spread_mask[1].bool()], contiguous[1])
    torch.testing.assert_close(moved[0][:2], contiguous[0][:2])
    assert torch.equal(moved[1, 1], torch.tensor(0.0))


def test_sum_pi_squared_ignores_vocabulary_padding():
    """The optimal token baseline's sum_v pi_v^2, from a TP rank's (here the whole) padded vocabulary slice."""
    from verl_mega.parallel.state import destroy_parallel, init_parallel
    from verl_mega.roles.logprobs import vocab_parallel_sum_pi_squared

    init_parallel(1, 1)
    try:
        logits = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        got = vocab_parallel_sum_pi_squared(logits, vocab_size=100)
    finally:
        destroy_parallel()
    want = (torch.softmax(logits[..., :100].double(), -1) ** 2).sum(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides,problem", [
    (["algorithm.adv_estimator=grpo_passk", "rollout.n=1"],
     "algorithm.adv_estimator=grpo_passk compares the responses to each prompt: set rollout.n >= 2, got rollout.n=1"),
    (["algorithm.adv_estimator=gae", "critic.enable=false"],
     "algorithm.adv_estimator=gae takes the critic's values: set critic.enable=true"),
    (["algorithm.tir_is_threshold=0"], "algorithm.tir_is_threshold must be > 0, got 0"),
])
def test_preflight_refuses_an_estimator_its_config_cannot_feed(overrides, problem):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    with pytest.raises(ConfigError) as refused:
        preflight_check(load_config(None, ["model.hf_path=x", *overrides]), 1, check_files=False)
    lines = str(refused.value).splitlines()[1:]
    assert len(lines) == 1 and problem in lines[0], lines


@pytest.mark.parametrize("estimator", ["remax", "opo", "gpg", "optimal_token_baseline", "tir_optimal_token_baseline",
                                       "grpo_passk"])
def test_preflight_accepts_each_new_estimator_with_groups(estimator):
    from verl_mega.config import load_config
    from verl_mega.trainer.preflight import preflight_check

    preflight_check(load_config(None, ["model.hf_path=x", f"algorithm.adv_estimator={estimator}", "rollout.n=2",
                                       "critic.enable=false"]), 1, check_files=False)


# The trainer runs of the tests below (name -> overrides of GRPO's demo recipe at a small size), all in one
# process of tests/workers/rl_cases_worker.py. What each stage does with its inputs is tested in process
# (tests/test_rl_learning.py, tests/test_rl_generation.py); these check the whole job's metrics.
ADVANTAGE_RUNS = {
    "remax": ["algorithm.adv_estimator=remax"],
    "optimal_token_baseline": ["algorithm.adv_estimator=optimal_token_baseline"],
    "bypass_mode": ["actor.loss.policy_loss=bypass_mode", "actor.ppo_epochs=2"],
}


@pytest.fixture(scope="module")
def advantage_runs(tmp_path_factory) -> dict[str, tuple[dict, list[dict]]]:
    """name -> (the worker's record: exit code and error; the metrics) of two steps of each of ADVANTAGE_RUNS
    (4 prompts x 2 samples), one process for all."""
    import json
    import os
    import subprocess
    import sys

    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("advantage_runs")
    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    train = write_rows(make_task_rows("copy", 16, seed=0, max_digits=2), root / "train.jsonl")
    common = ["--config", str(EXAMPLES / "grpo_demo.yaml"), f"model.hf_path={hf}", f"data.train_files=[{train}]",
              "trainer.total_steps=2", "data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=8",
              "actor.micro_batch_size=4", "actor.ppo_epochs=1", "trainer.tensorboard=false",
              "reward.function=tests.workers.rl_cases_worker:length_reward"]
    cases = [arg for name, overrides in ADVANTAGE_RUNS.items()
             for arg in ["--case", name, *common, f"trainer.run_dir={root / name}", *overrides]]
    out = root / "results.json"
    result = subprocess.run([sys.executable, "-m", "tests.workers.rl_cases_worker", str(out), *cases],
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {}
    for name, run in json.loads(out.read_text()).items():
        metrics = root / name / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        runs[name] = ({**run, "stderr": result.stderr[-3000:]}, [r for r in records if r.get("step", 0) > 0])
    return runs


def advantage_run(runs: dict, name: str) -> list[dict]:
    """That run's step metrics; fails naming the run (with its error) where it did not finish."""
    run, records = runs[name]
    assert run["code"] == 0, f"run {name}: exit {run['code']}\n{run['error'] or run['stderr']}"
    assert len(records) == 2, records
    return records


@pytest.mark.slow
def test_remax_run_scores_a_greedy_baseline_every_step(advantage_runs):
    """Each step generates and scores ReMax's greedy baseline (timed on its own) and the advantages take it:
    with the length reward, the samples' advantages are not all zero."""
    for record in advantage_run(advantage_runs, "remax"):
        assert record["timing/remax_baseline"] > 0 and "remax/baseline_mean" in record
        assert record["critic/advantages/max"] > record["critic/advantages/min"]


@pytest.mark.slow
def test_optimal_token_baseline_run_takes_the_old_log_prob_pass(advantage_runs):
    """The update is on-policy (which skips the old-log-prob pass), yet the estimator's old log-probs and sum pi^2
    are computed every step, and its baseline is not zero (the returns are not the advantages)."""
    for record in advantage_run(advantage_runs, "optimal_token_baseline"):
        assert "timing/old_log_prob" in record
        assert (record["critic/advantages/mean"], record["critic/advantages/max"]) != (
            record["critic/returns/mean"], record["critic/returns/max"])


@pytest.mark.slow
def test_bypass_mode_run_trains_two_epochs_without_the_old_log_prob_pass(advantage_runs):
    """verl's bypass mode in the trainer: two epochs per batch (off-policy), yet no old-log-prob pass runs; the
    loss takes the rollout engine's log-probs as the old ones."""
    for record in advantage_run(advantage_runs, "bypass_mode"):
        assert "timing/old_log_prob" not in record and "actor/pg_loss" in record


def test_every_verl_estimator_name_is_registered_and_the_vectorized_ones_are_the_same_math():
    from verl_mega.algorithms import ADV_ESTIMATORS

    verl_names = {"gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo",
                  "grpo_passk", "gpg", "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline",
                  "tir_optimal_token_baseline"}
    assert verl_names <= set(ADV_ESTIMATORS.names())
    scores, mask, index = torch.tensor([1.0, 0.0, 0.5, 2.0]), torch.ones(4, 3), [0, 0, 1, 1]
    for name in ("grpo", "rloo"):
        vectorized = ADV_ESTIMATORS.get(f"{name}_vectorized")(scores, mask, index)
        assert all(torch.equal(a, b) for a, b in zip(vectorized, ADV_ESTIMATORS.get(name)(scores, mask, index)))
