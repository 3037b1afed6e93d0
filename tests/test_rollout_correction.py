"""Rollout/training mismatch (algorithms/rollout_correction.py): every weight level, rejection option and metric
against numbers worked out by hand from verl's formulas, the weights' effect on the policy loss, the pre-flight
check's refusals and the retired keys of older configs.

The planted batch: two responses, the second one token shorter, with ratios π_train/π_rollout of
2, 0.5, 1 (row 0: product 1, geometric mean 1) and 4, 1 (row 1: product 4, geometric mean 2).
"""
import math

import pytest
import torch

from verl_mega.algorithms import (
    compute_policy_loss, mismatch_metrics, mismatch_metrics_by_source, rollout_correction,
    rollout_correction_from_config,
)
from verl_mega.config import ConfigError, load_config
from verl_mega.config.schema import RolloutCorrectionConfig
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
    correction = corrected(rollout_is=level, rollout_is_threshold=cap)
    torch.testing.assert_close(correction.loss_weights, torch.tensor(weights))
    assert correction.truncated.tolist() == torch.tensor(truncated, dtype=torch.bool).tolist()
    assert not correction.rejected.any()


# k1 = -log ρ, k2 = (log ρ)² / 2, k3 = ρ - 1 - log ρ per token:
#   row 0 (ρ = 2, 0.5, 1): k1 = -ln2, ln2, 0; k2 = 0.240, 0.240, 0; k3 = 0.307, 0.193, 0
#   row 1 (ρ = 4, 1):      k1 = -ln4, 0;      k2 = 0.961, 0;        k3 = 1.614, 0
@pytest.mark.parametrize("option, threshold, kept", [
    ("token_k1", "0.3_2.1", [[1, 1, 1], [0, 1, 0]]),  # ρ in [1/2.1, 1/0.3] = [0.48, 3.3]: 4 leaves
    ("token_k1", "2.5", [[1, 1, 1], [0, 1, 0]]),  # one number: lower = 1/upper, ρ in [0.4, 2.5]
    ("token_k2", "0.5", [[1, 1, 1], [0, 1, 0]]),
    ("token_k3", "0.25", [[0, 1, 1], [0, 1, 0]]),  # k3 tells ρ = 2 (0.307) from ρ = 0.5 (0.193)
    ("seq_sum_k1", "0.2_0.5", [[0, 0, 0], [1, 1, 0]]),  # product 1 leaves [2, 5], product 4 stays
    ("seq_sum_k2", "0.5", [[1, 1, 1], [0, 0, 0]]),  # sums 0.480, 0.961
    ("seq_sum_k3", "0.6", [[1, 1, 1], [0, 0, 0]]),  # sums 0.5, 1.614
    ("seq_mean_k1", "0.4_0.6", [[0, 0, 0], [1, 1, 0]]),  # geometric means 1 and 2: only 2 in [1/0.6, 1/0.4]
    ("seq_mean_k2", "0.2", [[1, 1, 1], [0, 0, 0]]),  # means 0.160, 0.480
    ("seq_mean_k3", "0.2", [[1, 1, 1], [0, 0, 0]]),  # means 0.167, 0.807
    ("seq_max_k2", "0.2", [[0, 0, 0], [0, 0, 0]]),  # maxima 0.240, 0.961
    ("seq_max_k3", "0.31", [[1, 1, 1], [0, 0, 0]]),  # maxima 0.307, 1.614
])
def test_each_rejection_option_against_verls_formula(option, threshold, kept):
    correction = corrected(rollout_rs=option, rollout_rs_threshold=threshold)
    kept = torch.tensor(kept, dtype=torch.float32)
    torch.testing.assert_close(correction.loss_weights, kept)
    assert correction.rejected.tolist() == ((MASK > 0) & (kept == 0)).tolist()
    assert not correction.truncated.any()


def test_k1_bounds_bound_minus_log_ratio_as_verl_does():
    """The issue's worked example: ρ = 0.65, 1, 1.5 with verl's 0.6_1.4 keeps ρ in [1/1.4, 1/0.6] = [0.71, 1.67];
    the old band [0.6, 1.4] on ρ itself kept 1, 1, 0."""
    rho = torch.tensor([[0.65, 1.0, 1.5]])
    ones = torch.ones_like(rho)
    kept = rollout_correction(rho.log(), 0 * rho, ones, rollout_rs="token_k1", rollout_rs_threshold="0.6_1.4")
    assert kept.loss_weights.tolist() == [[0.0, 1.0, 1.0]]


@pytest.mark.parametrize("options, thresholds, kept, per_option", [
    # token_k2 takes row 1's ρ = 4, the geometric mean 2 takes row 1 whole
    ("token_k2,seq_mean_k1", "0.5,0.9_1.1", [[1, 1, 1], [0, 0, 0]],
     {"token_k2": (1 / 5, 1 / 2), "seq_mean_k1": (2 / 5, 1 / 2)}),
    # one threshold shared by both; duplicates count once
    ("token_k2,seq_max_k2,token_k2", "0.3", [[1, 1, 1], [0, 0, 0]],
     {"token_k2": (1 / 5, 1 / 2), "seq_max_k2": (2 / 5, 1 / 2)}),
    ("token_k3,seq_sum_k1", "0.25,0.2_0.5", [[0, 0, 0], [0, 1, 0]],
     {"token_k3": (2 / 5, 1.0), "seq_sum_k1": (3 / 5, 1 / 2)}),
])
def test_chained_options_keep_what_every_option_keeps(options, thresholds, kept, per_option):
    correction = corrected(rollout_rs=options, rollout_rs_threshold=thresholds)
    torch.testing.assert_close(correction.loss_weights, torch.tensor(kept, dtype=torch.float32))
    metrics = mismatch_metrics(TRAIN, ROLLOUT, MASK, correction)
    for option, (tokens, responses) in per_option.items():
        assert metrics[f"rollout_rs_{option}_masked_fraction"] == pytest.approx(tokens), option
        assert metrics[f"rollout_rs_{option}_seq_masked_fraction"] == pytest.approx(responses), option
    rejected_tokens = 5 - sum(map(sum, kept))
    assert metrics["rejected_frac"] == pytest.approx(rejected_tokens / 5)
    assert metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(
        sum(any(not k for k in row[:n]) for row, n in zip(kept, (3, 2))) / 2)


@pytest.mark.parametrize("options, thresholds, message", [
    ("token_k4", "1", "token_k4 is not one of"),
    ("seq_max_k1", "1", "seq_max_k1 is not one of"),
    ("token_k1", None, "needs rollout_rs_threshold"),
    ("token_k2", "0.1_0.2", "only k1 options take lower_upper"),
    ("token_k1,token_k2", "1,2,3", "3 entries for 2 rollout_rs options"),
    ("token_k1", "0_2", "must be positive"),
])
def test_bad_rejection_specs_are_refused(options, thresholds, message):
    with pytest.raises(ValueError, match=message):
        corrected(rollout_rs=options, rollout_rs_threshold=thresholds)


@pytest.mark.parametrize("level, cap, normalised, mean", [
    ("token", 3.0, [[4 / 3, 1 / 3, 2 / 3], [2.0, 2 / 3, 0.0]], 1.5),  # token mean of 2, 0.5, 1, 3, 1
    ("sequence", 5.0, [[0.4, 0.4, 0.4], [1.6, 1.6, 0.0]], 2.5),  # mean over responses of 1 and 4
    ("geometric", 5.0, [[2 / 3, 2 / 3, 2 / 3], [4 / 3, 4 / 3, 0.0]], 1.5),  # of 1 and 2
])
def test_batch_normalised_weights_average_one(level, cap, normalised, mean):
    correction = corrected(rollout_is=level, rollout_is_threshold=cap, rollout_is_batch_normalize=True)
    torch.testing.assert_close(correction.loss_weights, torch.tensor(normalised))
    assert correction.batch_mean == pytest.approx(mean)
    given = corrected(rollout_is=level, rollout_is_threshold=cap, rollout_is_batch_normalize=True, batch_mean=2.0)
    torch.testing.assert_close(given.loss_weights, corrected(rollout_is=level, rollout_is_threshold=cap).loss_weights / 2)


def test_weights_and_rejection_together_weight_the_tokens_kept():
    correction = corrected(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1",
                           rollout_rs_threshold="0.4_1.7")  # ρ in [0.59, 2.5]: 0.5 and 4 go
    torch.testing.assert_close(correction.loss_weights, torch.tensor([[1.5, 0.0, 1.0], [0.0, 1.0, 0.0]]))


def test_the_config_section_gives_the_same_correction():
    config = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=3.0, rollout_rs="token_k3",
                                     rollout_rs_threshold="0.25")
    from_config = rollout_correction_from_config(TRAIN, ROLLOUT, MASK, config)
    direct = corrected(rollout_is="sequence", rollout_is_threshold=3.0, rollout_rs="token_k3",
                       rollout_rs_threshold="0.25")
    torch.testing.assert_close(from_config.loss_weights, direct.loss_weights)


def test_off_changes_nothing():
    correction = corrected()
    assert correction.loss_weights is None
    assert not correction.truncated.any() and not correction.rejected.any()


def test_mismatch_metrics_by_hand():
    correction = corrected(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1",
                           rollout_rs_threshold="0.4_1.7")
    metrics = mismatch_metrics(TRAIN, ROLLOUT, MASK, correction)
    ln2, ln4 = math.log(2), math.log(4)
    clamped = [1.5, 2 / 3, 1, 1.5, 1]
    clamped_mean, clamped_square_mean = sum(clamped) / 5, sum(w * w for w in clamped) / 5
    training = [-math.log(0.5 * 0.2 * 0.9) / 3, -math.log(0.4 * 0.3) / 2]  # each response's mean NLL
    rollout = [-math.log(0.25 * 0.4 * 0.9) / 3, -math.log(0.1 * 0.3) / 2]
    expected = {
        "kl_k1": (-ln2 + ln2 - ln4) / 5,  # mean of log(π_r / π_t)
        "kl_k3": ((2 - 1 - ln2) + (0.5 - 1 + ln2) + (4 - 1 - ln4)) / 5,  # mean of ρ - 1 - log ρ
        "ratio_mean": (2 + 0.5 + 1 + 4 + 1) / 5, "ratio_min": 0.5, "ratio_max": 4.0,
        "chi2_token": (4 + 0.25 + 1 + 16 + 1) / 5 - 1,  # E[ρ²] - 1 over the tokens
        "chi2_seq": (1 ** 2 + 4 ** 2) / 2 - 1,  # E[(Π ρ)²] - 1 over the responses: products 1 and 4
        "training_log_ppl": sum(training) / 2, "rollout_log_ppl": sum(rollout) / 2,
        "training_ppl": sum(map(math.exp, training)) / 2, "rollout_ppl": sum(map(math.exp, rollout)) / 2,
        "log_ppl_diff": (0 + -ln4 / 2) / 2,  # per response: mean NLL under training minus under the rollout
        "log_ppl_abs_diff": ln2 / 2, "log_ppl_diff_max": 0.0, "log_ppl_diff_min": -ln2,
        "ppl_ratio": (1 + 0.5) / 2,  # mean of the per-response perplexity ratios e^0, e^-ln2
        "is_truncated_frac": 2 / 5, "rejected_frac": 2 / 5,
        # the untruncated token weights 2, 0.5, 1, 4, 1 and, clamped to [1/1.5, 1.5], 1.5, 2/3, 1, 1.5, 1
        "rollout_is_mean": 8.5 / 5, "rollout_is_max": 4.0, "rollout_is_min": 0.5,
        "rollout_is_ratio_fraction_high": 2 / 5, "rollout_is_ratio_fraction_low": 1 / 5,
        "rollout_is_std": math.sqrt(clamped_square_mean - clamped_mean**2),
        "rollout_is_eff_sample_size": clamped_mean**2 / clamped_square_mean,  # (Σw)² / (n Σw²)
        "rollout_is_seq_mean": (3.5 / 3 + 2.5) / 2, "rollout_is_seq_std": math.sqrt(2) * abs(2.5 - 3.5 / 3) / 2,
        "rollout_is_seq_max": 2.5, "rollout_is_seq_min": 3.5 / 3, "rollout_is_seq_max_deviation": 1.5,
        "rollout_is_seq_fraction_high": 1 / 2, "rollout_is_seq_fraction_low": 0.0,  # 2.5 > 1.5
        "rollout_rs_seq_masked_fraction": 1.0, "rollout_rs_token_k1_masked_fraction": 2 / 5,
        "rollout_rs_token_k1_seq_masked_fraction": 1.0,
        # token_k1's statistic -log ρ: -ln2, ln2, 0 | -ln4, 0 against the band [log 0.4, log 1.7]; the rows' means
        # 0 and -ln2; the spread of the statistic clipped to the band
        "rollout_rs_token_k1_mean": -ln4 / 5, "rollout_rs_token_k1_max": ln2, "rollout_rs_token_k1_min": -ln4,
        "rollout_rs_token_k1_fraction_high": 1 / 5, "rollout_rs_token_k1_fraction_low": 1 / 5,
        "rollout_rs_token_k1_std": _spread([-ln2, math.log(1.7), 0, math.log(0.4), 0]),
        "rollout_rs_token_k1_seq_mean": -ln2 / 2, "rollout_rs_token_k1_seq_std": ln2 / math.sqrt(2),
        "rollout_rs_token_k1_seq_max": 0.0, "rollout_rs_token_k1_seq_min": -ln2,
        "rollout_rs_token_k1_seq_max_deviation": ln2, "rollout_rs_token_k1_seq_fraction_high": 0.0,
        "rollout_rs_token_k1_seq_fraction_low": 0.0,
    }
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


def _spread(values):
    mean = sum(values) / len(values)
    return math.sqrt(sum(v * v for v in values) / len(values) - mean**2)


def test_a_row_options_statistic_is_counted_over_responses():
    """seq_mean_k2: the rows' mean ½(log ρ)², ln²2/3 and ln²4/4, against 0.3: the second row is out."""
    correction = corrected(rollout_rs="seq_mean_k2", rollout_rs_threshold="0.3")
    metrics = mismatch_metrics(TRAIN, ROLLOUT, MASK, correction)
    ln2 = math.log(2)
    rows = [ln2**2 / 3, 4 * ln2**2 / 4]
    assert {key: metrics[key] for key in metrics if key.startswith("rollout_rs_seq_mean_k2_")} == pytest.approx({
        "rollout_rs_seq_mean_k2_mean": (3 * rows[0] + 2 * rows[1]) / 5,  # the row value on each of its tokens
        "rollout_rs_seq_mean_k2_max": rows[1], "rollout_rs_seq_mean_k2_min": rows[0],
        "rollout_rs_seq_mean_k2_fraction_high": 1 / 2, "rollout_rs_seq_mean_k2_fraction_low": 0.0,
        "rollout_rs_seq_mean_k2_std": _spread([rows[0]] * 3 + [0.3] * 2),
        "rollout_rs_seq_mean_k2_seq_mean": sum(rows) / 2,
        "rollout_rs_seq_mean_k2_seq_std": abs(rows[1] - rows[0]) / math.sqrt(2),
        "rollout_rs_seq_mean_k2_seq_max": rows[1], "rollout_rs_seq_mean_k2_seq_min": rows[0],
        "rollout_rs_seq_mean_k2_seq_max_deviation": rows[1], "rollout_rs_seq_mean_k2_seq_fraction_high": 1 / 2,
        "rollout_rs_seq_mean_k2_masked_fraction": 2 / 5, "rollout_rs_seq_mean_k2_seq_masked_fraction": 1 / 2,
    }, rel=1e-6)


def test_effective_sample_size_is_one_for_equal_weights_and_falls_with_their_spread():
    assert mismatch_metrics(TRAIN, TRAIN, MASK, rollout_correction(TRAIN, TRAIN, MASK, rollout_is="token")
                            )["rollout_is_eff_sample_size"] == pytest.approx(1.0)
    # one weight 4, four weights 1 (cap 4): (8 / 5)² / (20 / 5)
    rollout = TRAIN.clone()
    rollout[1, 0] = TRAIN[1, 0] - math.log(4)
    spread = mismatch_metrics(TRAIN, rollout, MASK, rollout_correction(TRAIN, rollout, MASK, rollout_is="token",
                                                                       rollout_is_threshold=4.0))
    assert spread["rollout_is_eff_sample_size"] == pytest.approx((8 / 5) ** 2 / 4)


def test_metrics_per_data_source_cover_that_sources_rows():
    correction = corrected(rollout_is="token", rollout_is_threshold=1.5)
    metrics = mismatch_metrics_by_source(TRAIN, ROLLOUT, MASK, correction, ["a", "b"])
    assert metrics["ratio_max"] == pytest.approx(4.0)
    assert (metrics["ratio_min/a"], metrics["ratio_max/a"]) == pytest.approx((0.5, 2.0))  # row 0: 2, 0.5, 1
    assert (metrics["ratio_min/b"], metrics["ratio_max/b"]) == pytest.approx((1.0, 4.0))  # row 1: 4, 1
    assert metrics["kl_k1/a"] == pytest.approx(0.0, abs=1e-7) and metrics["kl_k1/b"] == pytest.approx(-math.log(4) / 2)
    assert (metrics["is_truncated_frac/a"], metrics["is_truncated_frac/b"]) == pytest.approx((1 / 3, 1 / 2))
    assert (metrics["rollout_is_seq_mean/a"], metrics["rollout_is_seq_mean/b"]) == pytest.approx((3.5 / 3, 2.5))
    without_sources = mismatch_metrics_by_source(TRAIN, ROLLOUT, MASK, correction, [None, None])
    assert without_sources == mismatch_metrics(TRAIN, ROLLOUT, MASK, correction)


def test_matching_distributions_measure_no_mismatch():
    metrics = mismatch_metrics(TRAIN, TRAIN, MASK, rollout_correction(TRAIN, TRAIN, MASK))
    assert metrics["kl_k1"] == metrics["kl_k3"] == metrics["log_ppl_diff"] == 0
    assert metrics["ratio_min"] == metrics["ratio_mean"] == metrics["ratio_max"] == 1
    assert metrics["chi2_token"] == metrics["chi2_seq"] == 0 and metrics["ppl_ratio"] == 1


def test_truncated_weights_scale_each_tokens_policy_gradient_loss():
    """At ratio 1 (new = old log-probs) and no clipping each token's loss is -A: token-mean of -w * A."""
    def pg_loss(rollout_log_prob, **modes):
        correction = rollout_correction(TRAIN, rollout_log_prob, MASK, **modes)
        return compute_policy_loss(TRAIN, TRAIN, ADVANTAGES, MASK, rollout_is_weights=correction.loss_weights)[0]

    unweighted = -(1 + 2 - 1 + 0.5 - 2) / 5
    assert pg_loss(TRAIN, rollout_is="token", rollout_is_threshold=1.5).item() == pytest.approx(unweighted)  # no mismatch
    weighted = -(1.5 * 1 + 0.5 * 2 + 1 * -1 + 1.5 * 0.5 + 1 * -2) / 5
    assert pg_loss(ROLLOUT, rollout_is="token", rollout_is_threshold=1.5).item() == pytest.approx(weighted)
    masked = -(1 - 1 - 2) / 5  # rejection: the 2 tokens rejected count as zeros in the token-mean
    rejected = pg_loss(ROLLOUT, rollout_rs="token_k1", rollout_rs_threshold="0.4_1.7")  # ρ = 0.5 and 4 go
    assert rejected.item() == pytest.approx(masked)


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


PREFIX = "algorithm.rollout_correction"


@pytest.mark.parametrize("overrides, message", [
    (["rollout_is=tokens"], f"{PREFIX}.rollout_is 'tokens' is unknown; known: token, sequence, geometric (null: off)"),
    (["rollout_is_threshold=0"], f"{PREFIX}.rollout_is_threshold must be > 0 (inf: no limit; 2 is usual), got 0.0"),
    (["rollout_rs=seq"], f"{PREFIX}.rollout_rs 'seq': seq is not one of seq_max_k2"),
    (["rollout_rs=token_k1"], f"{PREFIX}.rollout_rs=token_k1 needs rollout_rs_threshold"),
    (["rollout_rs=seq_mean_k3", "rollout_rs_threshold=0.5_2"], f"{PREFIX}.rollout_rs_threshold '0.5_2' for "
                                                                "seq_mean_k3: only k1 options take lower_upper"),
    (["rollout_is_batch_normalize=true"], f"{PREFIX}.rollout_is_batch_normalize normalises the importance "
                                          f"weights, and {PREFIX}.rollout_is is null"),
    (["rollout_is=token", "rollout_is_batch_normalize=true", "+actor.loss.policy_loss=bypass_mode",
      "+actor.loss.bypass_loss_type=reinforce"], f"{PREFIX}.rollout_is_batch_normalize with "
                                                 "actor.loss.policy_loss=bypass_mode (reinforce)"),
])
def test_preflight_refuses_bad_keys_in_one_line_naming_the_key(tiny_models, prompt_file, overrides, message):
    keys = [item[1:] if item.startswith("+") else f"{PREFIX}.{item}" for item in overrides]
    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]",
                                "data.batch_size=1", "actor.mini_batch_size=1", "critic.mini_batch_size=1", *keys])
    with pytest.raises(ConfigError) as err:
        preflight_check(config, world_size=1)
    lines = [line for line in str(err.value).splitlines() if "rollout_correction" in line]
    assert len(lines) == 1 and message in lines[0], str(err.value)


OLD_SECTION = """algorithm:
  rollout_correction:
    weights: none
    weight_cap: 2.0
    reject: none
    reject_low: 0.5
    reject_high: 2.0
"""


def test_a_saved_config_with_the_retired_keys_at_their_defaults_still_loads(tmp_path):
    """A run folder's config.yaml written before verl's keys holds the old ones at their defaults (which did
    nothing): it reads back as the default section, so a resume compares equal."""
    saved = tmp_path / "config.yaml"
    saved.write_text("model:\n  hf_path: m\n" + OLD_SECTION)
    assert load_config(saved).algorithm.rollout_correction == RolloutCorrectionConfig()


@pytest.mark.parametrize("override, replacement", [
    ("weights=token", "set algorithm.rollout_correction.rollout_is (the same levels"),
    ("weight_cap=3", "set algorithm.rollout_correction.rollout_is_threshold"),
    ("reject=geometric", "set algorithm.rollout_correction.rollout_rs (token: token_k1, sequence: seq_sum_k1, "
                         "geometric: seq_mean_k1)"),
    ("reject_low=0.6", "rollout_rs_threshold=<1/HIGH>_<1/LOW>"),
    ("reject_high=1.4", "rollout_rs_threshold=<1/HIGH>_<1/LOW>"),
])
def test_a_retired_key_set_to_act_is_refused_in_one_line_naming_its_replacement(override, replacement):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.hf_path=m", f"{PREFIX}.{override}"])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{PREFIX}.{override.split('=')[0]}=") and replacement in message
