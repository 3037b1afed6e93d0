"""KL estimators, KL-in-reward penalty and KL controllers."""

import math

import pytest
import torch

from verl_mega.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl,
    get_kl_controller,
)

# Two tokens: d = log_prob - ref_log_prob = +1 and -1.
LOG_PROB = torch.tensor([[0.0, -1.0]])
REF_LOG_PROB = torch.tensor([[-1.0, 0.0]])


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("k1", [1.0, -1.0]),  # d
        ("kl", [1.0, -1.0]),
        ("abs", [1.0, 1.0]),  # |d|
        ("k2", [0.5, 0.5]),  # 0.5 * d^2
        ("mse", [0.5, 0.5]),
        # r = ref - logp = -d; exp(r) - r - 1: exp(-1) + 1 - 1, exp(1) - 1 - 1
        ("k3", [math.exp(-1.0), math.e - 2.0]),
        ("low_var_kl", [math.exp(-1.0), math.e - 2.0]),
    ],
)
def test_kl_estimator_values_on_known_pair(estimator, expected):
    torch.testing.assert_close(compute_kl(LOG_PROB, REF_LOG_PROB, estimator), torch.tensor([expected]))


def test_low_var_kl_is_clamped_to_ten():
    # r = 15: exp(15) - 16 is about 3.3e6, clamped to 10 as verl does.
    assert compute_kl(torch.tensor([0.0]), torch.tensor([15.0]), "k3").item() == 10.0


def test_compute_kl_shape_mismatch_names_argument():
    with pytest.raises(ValueError, match="ref_log_prob"):
        compute_kl(LOG_PROB, REF_LOG_PROB[:, :1])


def test_apply_kl_penalty_subtracts_beta_times_masked_kl():
    scores = torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    old_log_prob = torch.zeros(2, 3)
    ref_log_prob = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -3.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rewards, current_kl = apply_kl_penalty(scores, old_log_prob, ref_log_prob, mask, kl_coef=0.1, estimator="k1")
    # masked k1 = [[1, 2, 0], [0.5, 0, 0]]; rewards = scores - 0.1 * kl
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, -0.2, 1.0], [1.95, 0.0, 0.0]]))
    # per-sequence mean KL [3/3, 0.5/1] -> batch mean 0.75
    assert current_kl.item() == pytest.approx(0.75)


def test_adaptive_controller_raises_beta_above_target_and_lowers_it_below():
    above = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    # error = clip(1.5 / 1 - 1, -0.2, 0.2) = 0.2; beta *= 1 + 0.2 * 10 / 100
    above.update(current_kl=1.5, n_steps=10)
    assert above.value == pytest.approx(0.102)

    below = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    # error = 0.9 - 1 = -0.1; beta *= 1 - 0.1 * 10 / 100
    below.update(current_kl=0.9, n_steps=10)
    assert below.value == pytest.approx(0.099)


def test_fixed_controller_never_moves():
    controller = FixedKLController(kl_coef=0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.05


def test_controller_state_dict_round_trip():
    trained = get_kl_controller("adaptive", kl_coef=0.1, target_kl=1.0, horizon=100)
    trained.update(current_kl=2.0, n_steps=50)
    restored = get_kl_controller("adaptive", kl_coef=0.1, target_kl=1.0, horizon=100)
    restored.load_state_dict(trained.state_dict())
    assert restored.value == trained.value != 0.1


def test_get_kl_controller_rejects_unknown_type_and_missing_target():
    with pytest.raises(ValueError, match="adaptive, fixed"):
        get_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="target_kl"):
        get_kl_controller("adaptive", kl_coef=0.1)
