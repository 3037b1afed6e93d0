"""Policy losses against their papers' formulas on hand-computed batches (values, and gradients where a
stop-gradient is the point), rollout IS weights, the clipped value loss and entropy."""

import math

import pytest
import torch

from verl_mega.algorithms import POLICY_LOSSES, agg_loss
from verl_mega.algorithms.losses import compute_value_loss, entropy_from_logits
from verl_mega.algorithms.policy_losses import (
    compute_policy_loss, get_policy_loss_fn, old_log_probs_from_rollout, policy_loss_metric_names,
)
from verl_mega.config import PolicyLossConfig


def policy_loss(ratios, advantages, mask=None, **kwargs):
    """Run the loss with old_log_prob = 0 so that ratio = exp(log_prob)."""
    log_prob = torch.tensor([ratios]).log().requires_grad_()
    advantages = torch.tensor([advantages])
    mask = torch.ones_like(advantages) if mask is None else torch.tensor([mask])
    return log_prob, compute_policy_loss(torch.zeros_like(log_prob), log_prob, advantages, mask, **kwargs)


def test_vanilla_policy_loss_hand_computed():
    # clip to [0.8, 1.28], dual-clip c = 3. Per token, loss = max(-A r, -A clip(r)), then min(., c|A|) if A < 0:
    #   A=+1 r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped)
    #   A=+1 r=1.1 -> -1.1 (inside the range)
    #   A=-1 r=0.5 -> max(0.5, 0.8) = 0.8 (clipped)
    #   A=-1 r=5.0 -> max(5.0, 1.28) = 5.0, dual-clipped to 3
    ratios, advantages = [1.5, 1.1, 0.5, 5.0], [1.0, 1.0, -1.0, -1.0]
    _, (pg_loss, metrics) = policy_loss(
        ratios, advantages, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0
    )
    assert pg_loss.item() == pytest.approx((-1.28 - 1.1 + 0.8 + 3.0) / 4)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 4)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 4)
    # ppo_kl = mean(old_log_prob - log_prob)
    assert metrics["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in ratios) / 4)


def test_asymmetric_clip_widens_only_the_upper_side():
    # A=+1, r=1.25: outside 1 + 0.2, inside 1 + 0.28
    _, (loss, metrics) = policy_loss([1.25], [1.0], clip_ratio=0.2)
    assert (loss.item(), metrics["pg_clipfrac"].item()) == (pytest.approx(-1.2), 1.0)
    _, (loss, metrics) = policy_loss([1.25], [1.0], clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert (loss.item(), metrics["pg_clipfrac"].item()) == (pytest.approx(-1.25), 0.0)
    # A=-1, r=0.75: clipped up to 0.8 with low=0.2, untouched with low=0.3
    _, (loss, metrics) = policy_loss([0.75], [-1.0], clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert (loss.item(), metrics["pg_clipfrac"].item()) == (pytest.approx(0.8), 1.0)
    _, (loss, metrics) = policy_loss([0.75], [-1.0], clip_ratio_low=0.3, clip_ratio_high=0.28)
    assert (loss.item(), metrics["pg_clipfrac"].item()) == (pytest.approx(0.75), 0.0)


def test_dual_clip_caps_negative_advantage_loss_and_its_gradient():
    # A=-2, r=10: -A r = 20 is capped at c |A| = 3 * 2 = 6; A=+2, r=10 is only clipped: -2 * 1.2
    log_prob, (pg_loss, metrics) = policy_loss([10.0, 10.0], [-2.0, 2.0], clip_ratio=0.2, clip_ratio_c=3.0)
    assert pg_loss.item() == pytest.approx((6.0 - 2.4) / 2)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(1 / 2)
    pg_loss.backward()
    assert log_prob.grad.abs().max().item() == 0.0  # both tokens sit on a constant bound


def test_policy_loss_ignores_masked_tokens_and_honours_agg_mode():
    # Token 2 is masked (its ratio would make the loss huge). Unmasked: -1 * 1 and -1 * 1 -> -1 each.
    ratios, advantages, mask = [1.0, 1.0, 50.0], [1.0, 1.0, -7.0], [1.0, 1.0, 0.0]
    _, (token_mean, _) = policy_loss(ratios, advantages, mask)
    assert token_mean.item() == pytest.approx(-1.0)
    _, (token_sum, _) = policy_loss(ratios, advantages, mask, loss_agg_mode="seq-mean-token-sum")
    assert token_sum.item() == pytest.approx(-2.0)


def test_policy_loss_rejects_bad_input():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss([1.0], [1.0], clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))


def test_vanilla_is_registered_with_its_metric_names():
    assert get_policy_loss_fn("vanilla") is compute_policy_loss
    assert policy_loss_metric_names("vanilla") == ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")


def test_value_loss_clips_around_old_values():
    # cliprange 0.5 around v_old = 0, so clipped v = clamp(v, -0.5, 0.5):
    #   v=1.0 R=2.0: (1-2)^2 = 1, (0.5-2)^2 = 2.25 -> 2.25 (clipped counts)
    #   v=1.0 R=0.0: (1-0)^2 = 1, (0.5-0)^2 = 0.25 -> 1
    #   v=0.2 R=1.0: inside the range, (0.2-1)^2 = 0.64
    vpreds = torch.tensor([[1.0, 1.0, 0.2]])
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    old_values = torch.zeros(1, 3)
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, old_values, returns, torch.ones(1, 3), cliprange_value=0.5)
    assert vf_loss.item() == pytest.approx(0.5 * (2.25 + 1.0 + 0.64) / 3)
    assert vf_clipfrac.item() == pytest.approx(1 / 3)


def test_value_loss_shape_mismatch_names_argument():
    with pytest.raises(ValueError, match="returns"):
        zeros = torch.zeros(1, 3)
        compute_value_loss(zeros, zeros, torch.zeros(1, 2), torch.ones(1, 3), cliprange_value=0.5)


def test_entropy_from_logits_and_aggregation():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0]]])
    entropy = entropy_from_logits(logits)
    # uniform over 4 -> log 4; the peaked one matches torch's Categorical
    torch.testing.assert_close(entropy[0, 0], torch.tensor(math.log(4.0)))
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=logits).entropy())
    # mask out the peaked token: the aggregate is the uniform entropy alone
    assert agg_loss(entropy, torch.tensor([[1.0, 0.0]])).item() == pytest.approx(math.log(4.0))


# --- the other policy losses, on small batches computed by hand --------------------------------------------------

VERL_NAMES = ["vanilla", "gspo", "cispo", "geo_mean", "sapo", "clip_cov", "kl_cov", "gpg", "bypass_mode"]


def run_loss(name, log_ratios, advantages, mask, log_prob=None, **kwargs):
    """The loss `name` at log_prob (default 0) and old_log_prob = log_prob - log_ratios; returns the leaf
    log_prob (for its gradient), the loss and its metrics."""
    log_ratios = torch.tensor(log_ratios)
    log_prob = torch.zeros_like(log_ratios) if log_prob is None else torch.tensor(log_prob)
    log_prob.requires_grad_()
    loss, metrics = get_policy_loss_fn(name)(log_prob.detach() - log_ratios, log_prob, torch.tensor(advantages),
                                             torch.tensor(mask), **kwargs)
    loss.backward()
    return log_prob, loss, metrics


def test_every_verl_name_is_registered_and_takes_every_knob():
    """A config written for verl names the same losses; the actor passes every knob to whichever it runs."""
    assert set(VERL_NAMES) <= set(POLICY_LOSSES.names())
    for name in POLICY_LOSSES.names():
        _, loss, metrics = run_loss(name, [[0.1, -0.1]], [[1.0, -1.0]], [[1.0, 1.0]], **PolicyLossConfig().knobs())
        assert torch.isfinite(loss)
        assert tuple(metrics) == policy_loss_metric_names(name)
        assert all(not value.requires_grad and value.dim() == 0 for value in metrics.values())


def test_a_typed_knob_repeated_in_extra_is_refused():
    with pytest.raises(ValueError, match="actor.loss.tau_pos"):
        PolicyLossConfig(extra={"tau_pos": 2.0}).knobs()
    assert PolicyLossConfig(extra={"beta": 0.5}).knobs()["beta"] == 0.5


def test_gspo_clips_whole_sequences_and_pushes_each_token_by_the_sequence_ratio():
    # Row 0: log-ratios 0.3, -0.1, 0.1 -> s0 = exp(0.1), inside [0.8, 1.2]; token advantages 1, 2, 3.
    # Row 1: log-ratios -0.5, -0.1 (third token masked, its ratio huge) -> s1 = exp(-0.3) = 0.741 < 0.8, A = -1:
    #   max(-A s1, -A clip(s1)) = max(0.741, 0.8) = 0.8, clipped: no gradient.
    # seq-mean-token-mean: row 0 = mean_t(-A_t s0) = -2 s0, row 1 = 0.8 -> loss = (-2 s0 + 0.8) / 2.
    s0 = math.exp(0.1)
    log_prob, loss, metrics = run_loss("gspo", [[0.3, -0.1, 0.1], [-0.5, -0.1, 30.0]],
                                       [[1.0, 2.0, 3.0], [-1.0, -1.0, -1.0]], [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]],
                                       loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx((-2 * s0 + 0.8) / 2)
    # Token t of row 0: d/d log pi_t = -A_t * s0 / (2 rows * 3 tokens): the *sequence's* ratio, not the token's
    # own exp(0.3) or exp(-0.1); without the stop-gradient each token would get the row's mean advantage instead.
    expected = torch.tensor([[-1 * s0 / 6, -2 * s0 / 6, -3 * s0 / 6], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(log_prob.grad, expected)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["ppo_kl"].item() == pytest.approx(-(0.3 - 0.1 + 0.1 - 0.5 - 0.1) / 5)


def test_cispo_weights_log_prob_by_the_clipped_ratio_without_its_gradient():
    # r = 1.5, 1.0, 0.5 -> weights clip(r, 0.8, 1.2) = 1.2, 1.0, 0.8; log pi = -0.5, -1.0, -2.0; A = 1, -1, 2.
    # loss_t = -w A log pi = 0.6, -1.0, 3.2; token-mean 2.8 / 3.
    log_prob, loss, metrics = run_loss("cispo", [[math.log(1.5), 0.0, math.log(0.5)]], [[1.0, -1.0, 2.0]],
                                       [[1.0, 1.0, 1.0]], log_prob=[[-0.5, -1.0, -2.0]])
    assert loss.item() == pytest.approx(2.8 / 3)
    # d/d log pi = -w A / 3: the clipped token 0 still learns (PPO would give it 0), and the weight's own
    # dependence on log pi adds nothing (token 1 would get 0 instead of 1/3 through it).
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.2, 1.0, -1.6]]) / 3)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 3)


def test_geo_mean_is_the_geometric_mean_ratio_clipped_per_token_in_log_space():
    # Row 0 (A = +1): log-ratios 0.3, -0.1 -> min(x, clip(x, -0.2, 0.2)) = 0.2, -0.1 -> ratio exp(0.05),
    # loss -exp(0.05).
    # Row 1 (A = -1): -0.5, 0.1, 0.4 -> max(x, clip(x)) = -0.2, 0.1, 0.4 -> ratio exp(0.1), loss +exp(0.1).
    log_prob, loss, metrics = run_loss("geo_mean", [[0.3, -0.1, 9.0], [-0.5, 0.1, 0.4]],
                                       [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]], [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]],
                                       loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx((-math.exp(0.05) + math.exp(0.1)) / 2, abs=1e-6)  # float32 difference
    # The clipped value is used for tokens 0 of both rows (no gradient); the others get ratio / (2 rows * length).
    expected = torch.tensor([[0.0, -math.exp(0.05) / 4, 0.0], [0.0, math.exp(0.1) / 6, math.exp(0.1) / 6]])
    torch.testing.assert_close(log_prob.grad, expected)
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(2 / 5)


def test_sapo_gates_softly_and_is_reinforce_at_ratio_one():
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau; tau = 1 for A > 0, 1.05 otherwise; loss_t = -f(r) A.
    ratios, advantages = [1.0, 1.5, 0.5], [1.0, 1.0, -1.0]
    taus = [1.0, 1.0, 1.05]
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    gates = [sigmoid(tau * (r - 1)) * 4 / tau for r, tau in zip(ratios, taus)]
    log_prob, loss, _ = run_loss("sapo", [[math.log(r) for r in ratios]], [advantages], [[1.0, 1.0, 1.0]])
    assert loss.item() == pytest.approx(-sum(g * a for g, a in zip(gates, advantages)) / 3)
    # d/d log pi = -A f'(r) r with f'(r) = 4 sigmoid (1 - sigmoid): exactly -A at r = 1 (REINFORCE).
    slopes = [4 * sigmoid(tau * (r - 1)) * (1 - sigmoid(tau * (r - 1))) * r for r, tau in zip(ratios, taus)]
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-s * a / 3 for s, a in zip(slopes, advantages)]]))
    assert log_prob.grad[0, 0].item() == pytest.approx(-1 / 3)


def test_gpg_is_the_plain_policy_gradient():
    log_prob, loss, _ = run_loss("gpg", [[5.0, -5.0]], [[2.0, -1.0]], [[1.0, 1.0]], log_prob=[[-0.5, -2.0]])
    assert loss.item() == pytest.approx((2.0 * 0.5 + -1.0 * 2.0) / 2)  # -A log pi, token-mean; ratios ignored
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-2.0, 1.0]]) / 2)


# A = 3, -1, -1, -1 (mean 0) and log pi = -1, -3, -2, -2 (mean -2): covariance terms (A - 0)(log pi + 2) = 3, 1, 0, 0.
COV_ADVANTAGES, COV_LOG_PROB = [[3.0, -1.0, -1.0, -1.0]], [[-1.0, -3.0, -2.0, -2.0]]


def test_clip_cov_cuts_the_gradient_of_a_high_covariance_token():
    # On-policy (r = 1): candidates have covariance in (1, 5): token 0 only; 0.25 * 4 tokens = 1 is cut.
    # loss_t = -A r = -3, 1, 1, 1 with token 0 zeroed -> 3 / 4.
    log_prob, loss, metrics = run_loss("clip_cov", [[0.0] * 4], COV_ADVANTAGES, [[1.0] * 4], log_prob=COV_LOG_PROB,
                                       clip_cov_ratio=0.25)
    assert loss.item() == pytest.approx(3 / 4)
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.25, 0.25, 0.25]]))
    assert metrics["pg_clipfrac"].item() == pytest.approx(1 / 4)
    # A token PPO already clipped is no candidate: r0 = 1.5 with A > 0 is clipped to 1.2, nothing else qualifies.
    _, loss, metrics = run_loss("clip_cov", [[math.log(1.5), 0.0, 0.0, 0.0]], COV_ADVANTAGES, [[1.0] * 4],
                                log_prob=COV_LOG_PROB, clip_cov_ratio=0.25)
    assert loss.item() == pytest.approx((-3 * 1.2 + 3) / 4)
    assert metrics["pg_clipfrac"].item() == 0.0


def test_clip_cov_draws_the_same_tokens_for_the_same_micro_batch_however_padded():
    """The draw depends on the micro-batch alone: not on the global RNG, nor on padding columns a trimmed
    micro-batch drops. The cut tokens are those without gradient (on-policy, every other token has -A / N)."""
    generator = torch.Generator().manual_seed(3)
    advantages, log_prob = torch.randn(4, 6, generator=generator), torch.randn(4, 6, generator=generator)
    mask = torch.ones(4, 6)
    mask[:, 4:] = 0  # the last two columns are padding
    cut_tokens = []
    for seed, width in enumerate((6, 4, 4)):
        torch.manual_seed(seed)
        leaf = log_prob[:, :width].clone().requires_grad_()
        loss, metrics = get_policy_loss_fn("clip_cov")(leaf.detach(), leaf, advantages[:, :width], mask[:, :width],
                                                       clip_cov_ratio=0.25, clip_cov_lb=-10.0, clip_cov_ub=10.0)
        loss.backward()
        assert metrics["pg_clipfrac"].item() == pytest.approx(4 / 16)  # 0.25 of the 16 response tokens
        cut_tokens.append((leaf.grad[:, :4] == 0).nonzero().tolist())
    assert len(cut_tokens[0]) == 4 and cut_tokens[0] == cut_tokens[1] == cut_tokens[2]


def test_kl_cov_penalises_the_largest_covariance_tokens():
    # kl_cov_ratio 0.5 of 4 tokens: the two largest covariance terms (tokens 0 and 1) get 0.1 * |log r|.
    log_ratios = [[0.1, -0.2, 0.3, 0.0]]
    log_prob, loss, metrics = run_loss("kl_cov", log_ratios, COV_ADVANTAGES, [[1.0] * 4], log_prob=COV_LOG_PROB,
                                       kl_cov_ratio=0.5)
    token_losses = [-3 * math.exp(0.1) + 0.01, math.exp(-0.2) + 0.02, math.exp(0.3), 1.0]
    assert loss.item() == pytest.approx(sum(token_losses) / 4, abs=1e-6)  # float32 sum of opposite terms
    # d/d log pi = -A r (no clip) + 0.1 sign(log r) on the penalised tokens
    expected = torch.tensor([[-3 * math.exp(0.1) + 0.1, math.exp(-0.2) - 0.1, math.exp(0.3), 1.0]]) / 4
    torch.testing.assert_close(log_prob.grad, expected)
    assert metrics["ppo_kl_abs"].item() == pytest.approx(0.6 / 4)
    assert metrics["ppo_kl"].item() == pytest.approx(-0.2 / 4)


@pytest.mark.parametrize("name", VERL_NAMES)
def test_rollout_is_weights_scale_each_tokens_loss(name):
    """The loss is linear in the weights (geo_mean aside: a sequence weight), ones change nothing, and they only
    weight: the metrics do not move."""
    generator = torch.Generator().manual_seed(0)
    log_prob = (-torch.rand(3, 4, generator=generator)).requires_grad_()
    old_log_prob = log_prob.detach() + 0.1 * torch.randn(3, 4, generator=generator)
    advantages = torch.randn(3, 4, generator=generator)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    knobs = dict(clip_cov_lb=-10.0, clip_cov_ub=10.0, clip_cov_ratio=0.25, kl_cov_ratio=0.25)

    def loss(weights):
        return get_policy_loss_fn(name)(old_log_prob, log_prob, advantages, mask, rollout_is_weights=weights, **knobs)

    unweighted, metrics = loss(None)
    torch.testing.assert_close(loss(torch.ones(3, 4))[0], unweighted)
    halved, halved_metrics = loss(torch.full((3, 4), 0.5))
    torch.testing.assert_close(halved, unweighted / 2)
    assert halved_metrics == metrics
    if name != "geo_mean":
        first, second = torch.rand(3, 4, generator=generator), torch.rand(3, 4, generator=generator)
        torch.testing.assert_close(loss(first)[0] + loss(second)[0], loss(first + second)[0])


def test_geo_mean_weights_each_response_by_its_weights_geometric_mean():
    args = (torch.zeros(2, 2), torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), torch.ones(2, 2))
    # on-policy: response losses -1 and +1; weights 4, 1 on row 0 (geometric mean 2), 1, 1 on row 1
    loss, _ = get_policy_loss_fn("geo_mean")(*args, loss_agg_mode="seq-mean-token-mean",
                                             rollout_is_weights=torch.tensor([[4.0, 1.0], [1.0, 1.0]]))
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 2, rel=1e-6)


def test_bypass_mode_is_ppo_on_the_rollout_ratio_or_weighted_reinforce():
    """verl's bypass mode: the old log-probs are the rollout's. ppo_clip is the vanilla loss on pi / pi_rollout;
    reinforce is -w A log pi with the given weights (hand-computed), and never clips."""
    rollout = torch.tensor([[-1.0, -2.0, -0.5]])
    log_prob = torch.tensor([[-0.8, -2.5, -0.5]], requires_grad=True)
    advantages, mask = torch.tensor([[1.0, -1.0, 2.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    bypass = get_policy_loss_fn("bypass_mode")
    assert old_log_probs_from_rollout("bypass_mode") and not old_log_probs_from_rollout("vanilla")
    clipped, clipped_metrics = bypass(rollout, log_prob, advantages, mask, clip_ratio=0.2)
    vanilla, vanilla_metrics = compute_policy_loss(rollout, log_prob, advantages, mask, clip_ratio=0.2)
    assert torch.equal(clipped, vanilla) and clipped_metrics.keys() == vanilla_metrics.keys()
    weights = torch.tensor([[1.5, 0.5, 1.0]])
    loss, metrics = bypass(rollout, log_prob, advantages, mask, bypass_loss_type="reinforce",
                           rollout_is_weights=weights)
    # token-mean over the 2 masked-in tokens of -w A log pi: (-(1.5)(1)(-0.8) - (0.5)(-1)(-2.5)) / 2
    assert loss.item() == pytest.approx((1.2 - 1.25) / 2)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.5 / 2, 0.5 / 2, 0.0]]))
    assert metrics["pg_clipfrac"].item() == 0 and metrics["pg_clipfrac_lower"].item() == 0
    assert metrics["ppo_kl"].item() == pytest.approx(((-1.0 + 0.8) + (-2.0 + 2.5)) / 2)
    with pytest.raises(ValueError, match="bypass_loss_type must be one of ppo_clip, reinforce"):
        bypass(rollout, log_prob, advantages, mask, bypass_loss_type="ppo")
