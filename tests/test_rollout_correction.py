"""Rollout/training mismatch (algorithms/rollout_correction.py): every weight and mask mode and every metric
against numbers worked out by hand, the weights' effect on the policy loss, and the pre-flight check's bounds.

The planted batch: two responses, the second one token shorter, with ratios π_train/π_rollout of
2, 0.5, 1 (row 0: product 1, geometric mean 1) and 4, 1 (row 1: product 4, geometric mean 2).
"""
import math

import pytest
import torch

from verl_mega.algorithms import (
    compute_policy_loss, mismatch_metrics, mismatch_metrics_by_source, rollout_correction,
)
from verl_mega.config import ConfigError, load_config
from verl_mega.trainer.preflight import preflight_check

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
TRAIN = torch.tensor([[0.5, 0.2, 0.9], [0.4, 0.3, 1.0]]).log() * MASK
ROLLOUT = torch.tensor([[0.25, 0.4, 0.9], [0.1, 0.3, 1.0]]).log() * MASK
ADVANTAGES = torch.tensor([[1.0, 2.0, -1.0], [0.5, -2.0, 0.0]])


def corrected(**modes):
    return rollout_correction(TRAIN, ROLLOUT, MASK, **modes)


@pytest.mark.parametrize("level, cap, weights, truncated", [
    ("token", 1.5, [[1.5, 0.5, 1.0], [1.5, 1.0, 0.0]], [[1, 0, 0], [1, 0, 0]]),
    ("token", 3.0, [[2.0, 0.5, 1.0], [3.0, 1.0, 0.0]], [[0, 0, 0], [1, 0, 0]]),
    ("sequence", 1.5, [[1.0, 1.0, 1.0], [1.5, 1.5, 0.0]], [[0, 0, 0], [1, 1, 0]]),
    ("sequence", 5.0, [[1.0, 1.0, 1.0], [4.0, 4.0, 0.0]], [[0, 0, 0], [0, 0, 0]]),
    ("geometric", 1.5, [[1.0, 1.0, 1.0], [1.5, 1.5, 0.0]], [[0, 0, 0], [1, 1, 0]]),
    ("geometric", 3.0, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]], [[0, 0, 0], [0, 0, 0]]),
])
def test_truncated_importance_weights_at_each_level(level, cap, weights, truncated):
    correction = corrected(weights=level, weight_cap=cap)
    torch.testing.assert_close(correction.loss_weights, torch.tensor(weights))
    assert correction.truncated.tolist() == torch.tensor(truncated, dtype=torch.bool).tolist()
    assert not correction.rejected.any()


@pytest.mark.parametrize("level, low, high, kept", [
    ("token", 0.6, 2.5, [[1, 0, 1], [0, 1, 0]]),  # 0.5 and 4 leave [0.6, 2.5]
    ("sequence", 0.6, 2.5, [[1, 1, 1], [0, 0, 0]]),  # the product 4 does, the whole row goes
    ("geometric", 0.6, 2.5, [[1, 1, 1], [1, 1, 0]]),  # the geometric mean 2 does not
    ("geometric", 0.6, 1.8, [[1, 1, 1], [0, 0, 0]]),
    ("token", 0.49, 4.01, [[1, 1, 1], [1, 1, 0]]),  # every ratio inside: all kept
])
def test_rejection_masks_tokens_or_whole_responses_outside_the_bounds(level, low, high, kept):
    correction = corrected(reject=level, reject_low=low, reject_high=high)
    kept = torch.tensor(kept, dtype=torch.float32)
    torch.testing.assert_close(correction.loss_weights, kept)
    assert correction.rejected.tolist() == ((MASK > 0) & (kept == 0)).tolist()
    assert not correction.truncated.any()


def test_weights_and_rejection_together_weight_the_tokens_kept():
    correction = corrected(weights="token", weight_cap=1.5, reject="token", reject_low=0.6, reject_high=2.5)
    torch.testing.assert_close(correction.loss_weights, torch.tensor([[1.5, 0.0, 1.0], [0.0, 1.0, 0.0]]))


def test_off_changes_nothing():
    correction = corrected()
    assert correction.loss_weights is None
    assert not correction.truncated.any() and not correction.rejected.any()


def test_mismatch_metrics_by_hand():
    correction = corrected(weights="token", weight_cap=1.5, reject="token", reject_low=0.6, reject_high=2.5)
    metrics = mismatch_metrics(TRAIN, ROLLOUT, MASK, correction)
    ln2, ln4 = math.log(2), math.log(4)
    expected = {
        "kl_k1": (-ln2 + ln2 - ln4) / 5,  # mean of log(π_r / π_t)
        "kl_k3": ((2 - 1 - ln2) + (0.5 - 1 + ln2) + (4 - 1 - ln4)) / 5,  # mean of ρ - 1 - log ρ
        "log_ppl_diff": (0 + -ln4 / 2) / 2,  # per response: mean NLL under training minus under the rollout
        "ratio_mean": (2 + 0.5 + 1 + 4 + 1) / 5, "ratio_min": 0.5, "ratio_max": 4.0,
        "is_truncated_frac": 2 / 5, "rejected_frac": 2 / 5,
    }
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6), name


def test_metrics_per_data_source_cover_that_sources_rows():
    correction = corrected(weights="token", weight_cap=1.5)
    metrics = mismatch_metrics_by_source(TRAIN, ROLLOUT, MASK, correction, ["a", "b"])
    assert metrics["ratio_max"] == pytest.approx(4.0)
    assert (metrics["ratio_min/a"], metrics["ratio_max/a"]) == pytest.approx((0.5, 2.0))  # row 0: 2, 0.5, 1
    assert (metrics["ratio_min/b"], metrics["ratio_max/b"]) == pytest.approx((1.0, 4.0))  # row 1: 4, 1
    assert metrics["kl_k1/a"] == pytest.approx(0.0, abs=1e-7) and metrics["kl_k1/b"] == pytest.approx(-math.log(4) / 2)
    assert (metrics["is_truncated_frac/a"], metrics["is_truncated_frac/b"]) == pytest.approx((1 / 3, 1 / 2))
    without_sources = mismatch_metrics_by_source(TRAIN, ROLLOUT, MASK, correction, [None, None])
    assert without_sources == mismatch_metrics(TRAIN, ROLLOUT, MASK, correction)


def test_matching_distributions_measure_no_mismatch():
    metrics = mismatch_metrics(TRAIN, TRAIN, MASK, rollout_correction(TRAIN, TRAIN, MASK))
    assert metrics["kl_k1"] == metrics["kl_k3"] == metrics["log_ppl_diff"] == 0
    assert metrics["ratio_min"] == metrics["ratio_mean"] == metrics["ratio_max"] == 1


def test_truncated_weights_scale_each_tokens_policy_gradient_loss():
    """At ratio 1 (new = old log-probs) and no clipping each token's loss is -A: token-mean of -w * A."""
    def pg_loss(rollout_log_prob, **modes):
        correction = rollout_correction(TRAIN, rollout_log_prob, MASK, **modes)
        return compute_policy_loss(TRAIN, TRAIN, ADVANTAGES, MASK, rollout_is_weights=correction.loss_weights)[0]

    unweighted = -(1 + 2 - 1 + 0.5 - 2) / 5
    assert pg_loss(TRAIN, weights="token", weight_cap=1.5).item() == pytest.approx(unweighted)  # no mismatch
    weighted = -(1.5 * 1 + 0.5 * 2 + 1 * -1 + 1.5 * 0.5 + 1 * -2) / 5
    assert pg_loss(ROLLOUT, weights="token", weight_cap=1.5).item() == pytest.approx(weighted)
    masked = -(1 - 1 - 2) / 5  # rejection: the 2 tokens rejected count as zeros in the token-mean
    assert pg_loss(ROLLOUT, reject="token", reject_low=0.6, reject_high=2.5).item() == pytest.approx(masked)


def test_no_weights_is_the_unweighted_loss_bitwise():
    old = TRAIN + 0.1 * MASK
    plain_loss, plain_metrics = compute_policy_loss(old, TRAIN, ADVANTAGES, MASK)
    loss, metrics = compute_policy_loss(old, TRAIN, ADVANTAGES, MASK, rollout_is_weights=None)
    assert torch.equal(plain_loss, loss)
    assert metrics.keys() == plain_metrics.keys()
    assert all(torch.equal(metrics[name], plain_metrics[name]) for name in metrics)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "copy: 1", "reward_model": {"ground_truth": "1"}}\n')
    return path


@pytest.mark.parametrize("override, message", [
    ("weights=tokens", "algorithm.rollout_correction.weights 'tokens' is unknown; known: none, token, sequence"),
    ("reject=seq", "algorithm.rollout_correction.reject 'seq' is unknown"),
    ("weight_cap=0", "algorithm.rollout_correction.weight_cap must be > 0 (inf: no limit; 2 is usual), got 0.0"),
    ("reject_low=2", "algorithm.rollout_correction.reject_low=2.0 must be below "
                     "algorithm.rollout_correction.reject_high=2.0"),
])
def test_preflight_refuses_bad_modes_and_bounds_naming_the_key(tiny_models, prompt_file, override, message):
    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]",
                                "data.batch_size=1", "actor.mini_batch_size=1", "critic.mini_batch_size=1",
                                f"algorithm.rollout_correction.{override}"])
    with pytest.raises(ConfigError) as err:
        preflight_check(config, world_size=1)
    lines = [line for line in str(err.value).splitlines() if "rollout_correction" in line]
    assert len(lines) == 1 and message in lines[0], str(err.value)
