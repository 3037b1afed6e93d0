"""Preference losses (DPO/cDPO, IPO, SimPO, ORPO, KTO) against the papers' formulas and hand-computed numbers."""

import math

import pytest
import torch

from verl_mega.algorithms import PREFERENCE_LOSSES, PairLogps, get_preference_loss_fn, kto_kl_baseline, pair_metrics


def softplus(x: float) -> float:
    """-log σ(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


def pair(chosen, rejected, ref_chosen=None, ref_rejected=None, chosen_tokens=1, rejected_tokens=1, grad=False):
    as_tensor = lambda value: None if value is None else torch.tensor([float(value)], dtype=torch.float64)  # noqa: E731
    chosen, rejected = as_tensor(chosen), as_tensor(rejected)
    if grad:
        chosen.requires_grad_()
        rejected.requires_grad_()
    return PairLogps(chosen, rejected, as_tensor(ref_chosen), as_tensor(ref_rejected), as_tensor(chosen_tokens),
                     as_tensor(rejected_tokens))


def test_registry_names_every_loss_of_the_issue():
    assert PREFERENCE_LOSSES.names() == ["dpo", "ipo", "kto", "orpo", "simpo"]
    with pytest.raises(ValueError, match="known: dpo, ipo, kto, orpo, simpo"):
        get_preference_loss_fn("rpo")


def test_dpo_hand_computed_with_and_without_label_smoothing():
    # Policy margin (-10) - (-12) = 2, reference margin 0: β·logits = 0.2.
    logps = pair(-10, -12, -11, -11)
    out = get_preference_loss_fn("dpo")(logps, beta=0.1)
    assert out.losses.item() == pytest.approx(softplus(-0.2))  # -log σ(0.2) = 0.598139
    assert out.losses.item() == pytest.approx(0.5981388693, abs=1e-9)
    assert out.chosen_rewards.item() == pytest.approx(0.1) and out.rejected_rewards.item() == pytest.approx(-0.1)
    # cDPO: 0.9·(-log σ(0.2)) + 0.1·(-log σ(-0.2)) = -log σ(0.2) + 0.1·0.2, since softplus(x) - softplus(-x) = x.
    smoothed = get_preference_loss_fn("dpo")(logps, beta=0.1, label_smoothing=0.1)
    assert smoothed.losses.item() == pytest.approx(0.5981388693 + 0.02, abs=1e-9)


def test_dpo_depends_only_on_the_margin_of_log_ratios_and_its_gradient_raises_it():
    base = get_preference_loss_fn("dpo")(pair(-10, -12, -11, -11), beta=0.5).losses
    shifted = get_preference_loss_fn("dpo")(pair(-7, -9, -8, -8), beta=0.5).losses
    torch.testing.assert_close(base, shifted)
    logps = pair(-10, -12, -11, -11, grad=True)
    get_preference_loss_fn("dpo")(logps, beta=0.5).losses.sum().backward()
    # ∂L/∂π_c = -β σ(-β·logits) = -(-∂L/∂π_r)
    expected = -0.5 * torch.sigmoid(torch.tensor(-1.0, dtype=torch.float64))
    torch.testing.assert_close(logps.chosen.grad[0], expected)
    torch.testing.assert_close(logps.rejected.grad[0], -expected)


def test_ipo_is_the_squared_distance_of_the_margin_to_half_inverse_beta():
    logps = pair(-10, -12, -11, -11)  # margin of log ratios = 2
    assert get_preference_loss_fn("ipo")(logps, beta=0.1).losses.item() == pytest.approx((2 - 5) ** 2)
    assert get_preference_loss_fn("ipo")(logps, beta=0.25).losses.item() == pytest.approx(0.0)


def test_simpo_uses_length_normalised_log_probs_and_the_gamma_margin_without_reference():
    # Chosen -10 over 5 tokens = -2 per token, rejected -12 over 4 = -3; β = 2, γ = 0.5: logits 2·1 - 0.5 = 1.5.
    logps = pair(-10, -12, chosen_tokens=5, rejected_tokens=4)
    out = get_preference_loss_fn("simpo")(logps, beta=2.0, gamma=0.5)
    assert out.losses.item() == pytest.approx(softplus(-1.5))  # 0.201413
    assert out.chosen_rewards.item() == pytest.approx(-4.0) and out.rejected_rewards.item() == pytest.approx(-6.0)


def test_orpo_is_chosen_nll_plus_weighted_log_odds_ratio_term():
    # Per-token likelihood 1/2 for chosen (odds 1) and 1/5 for rejected (odds 1/4): odds ratio 4, σ(log 4) = 4/5.
    logps = pair(3 * math.log(0.5), 2 * math.log(0.2), chosen_tokens=3, rejected_tokens=2)
    out = get_preference_loss_fn("orpo")(logps, beta=0.1)
    assert out.losses.item() == pytest.approx(math.log(2) - 0.1 * math.log(0.8), abs=1e-12)  # 0.7154615
    assert out.chosen_rewards.item() == pytest.approx(0.1 * math.log(0.5))


def test_orpo_stays_finite_when_a_completion_is_almost_certain():
    logps = pair(-1e-7, -3.0, chosen_tokens=1, rejected_tokens=1, grad=True)
    out = get_preference_loss_fn("orpo")(logps, beta=0.1)
    out.losses.sum().backward()
    assert torch.isfinite(out.losses).all() and torch.isfinite(logps.chosen.grad).all()


def test_reference_losses_refuse_missing_reference_log_probs():
    with pytest.raises(ValueError, match="reference model's log-probs"):
        get_preference_loss_fn("dpo")(pair(-1, -2))


def test_pair_metrics_margins_and_accuracy():
    logps = PairLogps(torch.tensor([-1.0, -5.0]), torch.tensor([-2.0, -3.0]), torch.zeros(2), torch.zeros(2),
                      torch.ones(2), torch.ones(2))
    metrics = pair_metrics(logps, get_preference_loss_fn("dpo")(logps, beta=1.0))
    assert metrics["rewards/margins"].tolist() == [1.0, -2.0]
    assert metrics["rewards/accuracy"].tolist() == [1.0, 0.0]
    assert metrics["logps/chosen"].tolist() == [-1.0, -5.0]


def test_kto_hand_computed_with_weights_and_kl_baseline():
    # β = 0.1, z₀ = 0.5. Desirable r = 3: 1 - σ(0.1·2.5) = σ(-0.25); undesirable r = -1: 1.5·(1 - σ(0.1·1.5)).
    losses, rewards = get_preference_loss_fn("kto")(
        torch.tensor([3.0, -1.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
        torch.tensor([True, False]), torch.tensor(0.5, dtype=torch.float64), beta=0.1, desirable_weight=1.0,
        undesirable_weight=1.5)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert losses.tolist() == pytest.approx([sigmoid(-0.25), 1.5 * sigmoid(-0.15)])  # 0.437823, 0.693856
    assert rewards.tolist() == pytest.approx([0.3, -0.1])


def test_kto_kl_baseline_is_the_batch_mean_clamped_at_zero_and_detached():
    policy = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    assert kto_kl_baseline(policy, torch.tensor([-2.0, -2.0, -2.5])).item() == pytest.approx(0.5 / 3)
    below = kto_kl_baseline(policy, torch.zeros(3))
    assert below.item() == 0.0 and not below.requires_grad
