"""The actor's update does not depend on which passes computed its inputs, nor on how rows are grouped into
micro-batches (tests/workers/update_passes_worker.py under torchrun, 2 processes, tiny Qwen2, fp32: a case of the layout
grids' 2-process launch, tests/layout_grid.py, on the role grid's model and checkpoints).

- The reference pass runs only when a KL term can be non-zero (fast, config only).
- Old log-probs taken from the update's first forward (one epoch over one mini-batch) give bitwise the same
  weights and metrics as a separate forward pass.
- Micro-batches grouped by a token budget (DP2, the ranks then run different numbers of micro-batches) give
  the fixed-size micro-batches' log-probs, metrics and weight updates within fp32 rounding (RTOL below).
- On the CPU every megatron linear layer adds its weight gradient into DDP's buffer inside the GEMM, and the
  update equals megatron's unfused path within the same rounding.
"""
import pytest
import torch

from verl_mega.config import TrainConfig
from verl_mega.trainer.rl.needs import uses_reference

from layout_grid import SHARED_CASES

# The two runs compute the same sums in other orders and with other matrix shapes (other blockings). In fp32
# (unit roundoff u = 2**-24 = 6e-8) a sum of n terms reordered moves by about sqrt(n) u relative to the sum of
# magnitudes: n ~ 1e4 (a weight gradient over the hidden size and the tokens of a mini-batch) gives ~6e-6 per
# sum, carried through the forward and backward of 2 layers and 2 Adam steps (~8 such sums in a chain): 5e-5.
# Adam with eps comparable to the gradient and gradient clipping pass relative errors through unchanged.
RTOL = 5e-5


def rel_diff(value, reference) -> float:
    value, reference = torch.as_tensor(value, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
    return ((value - reference).norm() / reference.norm().clamp_min(1e-12)).item()


def whole_update(weights: dict, initial: dict) -> torch.Tensor:
    return torch.cat([(weights[name] - initial[name]).flatten() for name in sorted(initial)])


@pytest.fixture(scope="module")
def results(layout_grid):
    from safetensors.torch import load_file

    assert "update_passes" in SHARED_CASES[2]
    results = {path.stem: torch.load(path) for path in (layout_grid / "passes").glob("*.pt")}
    results["initial"] = load_file(layout_grid / "roles" / "hf" / "model.safetensors")
    return results


@pytest.mark.slow
def test_old_log_probs_from_the_first_forward_give_the_same_update(results):
    separate, first_forward = results["skip_old_pass"]["separate_pass"], results["skip_old_pass"]["first_forward"]
    assert first_forward["metrics"] == separate["metrics"]
    assert first_forward["weights"].keys() == separate["weights"].keys()
    for name, tensor in separate["weights"].items():
        assert torch.equal(first_forward["weights"][name], tensor), name


@pytest.mark.slow
def test_rollout_log_probs_with_the_correction_off_leave_the_update_bitwise(results):
    plain, with_rollout = results["skip_old_pass"]["first_forward"], results["skip_old_pass"]["rollout_log_probs"]
    assert with_rollout["metrics"] == plain["metrics"]
    for name, tensor in plain["weights"].items():
        assert torch.equal(with_rollout["weights"][name], tensor), name


@pytest.mark.slow
def test_the_on_policy_update_hands_back_its_first_forward_log_probs(results):
    """Without an old-log-prob pass, the mismatch metrics read the update's own first forward: bitwise the
    separate pass's log-probs, gathered over the ranks into batch order."""
    runs = results["skip_old_pass"]
    assert runs["first_forward"]["first_forward_log_probs"] is None  # no rollout log-probs, nothing kept
    kept = runs["rollout_log_probs"]["first_forward_log_probs"]
    assert kept.dtype == torch.float32 and torch.equal(kept, runs["separate_pass"]["old_log_probs"])


@pytest.mark.slow
def test_truncated_importance_weights_change_the_update(results):
    """Planted rollout log-probs ~0.3 nats off with token-level TIS (cap 1.2): the weights reach the loss."""
    plain, tis = results["skip_old_pass"]["rollout_log_probs"], results["skip_old_pass"]["token_tis"]
    assert abs(tis["metrics"]["pg_loss"] - plain["metrics"]["pg_loss"]) > 1e-3 * abs(plain["metrics"]["pg_loss"])
    assert any(not torch.equal(tis["weights"][name], tensor) for name, tensor in plain["weights"].items())


@pytest.mark.slow
def test_bypass_mode_is_vanilla_ppo_with_the_rollout_log_probs_as_the_old_ones(results):
    """Two epochs of two mini-batches without old log-probs: bypass mode takes the rollout's, bitwise what vanilla
    PPO does given them; off-policy, no first forward is kept for the mismatch metrics."""
    bypass, vanilla = results["skip_old_pass"]["bypass_mode"], results["skip_old_pass"]["vanilla_on_rollout"]
    assert bypass["metrics"] == vanilla["metrics"]
    for name, tensor in vanilla["weights"].items():
        assert torch.equal(bypass["weights"][name], tensor), name
    assert bypass["first_forward_log_probs"] is None


@pytest.mark.slow
def test_trainer_log_probs_at_the_rollout_temperature(results):
    """The actor's and the reference's log-probs at temperature 0.7 (TP 2) are HF's on logits / 0.7."""
    run = results["temperature"]
    mask = run["response_mask"].bool()
    for role in ("actor", "reference"):
        torch.testing.assert_close(run[role][mask], run["hf"][mask], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_weight_gradients_added_in_the_gemm_give_the_unfused_update(results):
    fused = results["fused_weight_gradients"]
    assert fused["fused_flags"] and all(fused["fused_flags"])  # the CPU default, on every linear layer
    # A micro-batch's gradient is added to the running sum inside the GEMM instead of after it: the same terms
    # summed in another order. Measured on the whole update, as below.
    initial = results["initial"]
    assert rel_diff(whole_update(fused["fused"], initial), whole_update(fused["unfused"], initial)) <= RTOL


@pytest.mark.slow
def test_token_budget_update_equals_fixed_micro_batches(results):
    fixed, budget = results["token_budget"]["fixed"], results["token_budget"]["budget"]
    assert fixed["micro_batches"] == [2, 2] and budget["micro_batches"] == [3, 4]
    assert_same_update(results, fixed, budget)


@pytest.mark.slow
def test_rollout_correction_update_does_not_depend_on_the_micro_batches(results):
    """Truncated weights and rejection (a rejected token is a zero in the loss's mean, never a change of its
    units) give the same update at DP 2 with fixed micro-batches and with a token budget's."""
    runs = results["token_budget"]
    fixed, budget = runs["corrected_fixed"], runs["corrected_budget"]
    assert abs(fixed["metrics"]["pg_loss"] - runs["fixed"]["metrics"]["pg_loss"]) > 1e-4  # the correction acts
    assert_same_update(results, fixed, budget)


def assert_same_update(results, fixed, budget):
    """The token-budget run's log-probs, metrics and weight update equal the fixed micro-batches' within RTOL."""
    mask = results["token_budget"]["response_mask"].bool()
    assert rel_diff(budget["log_probs"][mask], fixed["log_probs"][mask]) <= RTOL
    for name, value in fixed["metrics"].items():
        assert abs(budget["metrics"][name] - value) <= RTOL * max(abs(value), 1e-3), name
    # Rounding errors are absolute, of the size of the terms summed; a tensor whose gradient nearly cancels
    # (a norm weight, say) has a small update with the same absolute error, so the errors are measured
    # against the whole update, not tensor by tensor.
    initial = results["initial"]
    updates = {run: whole_update(result["weights"], initial) for run, result in (("fixed", fixed), ("budget", budget))}
    worst = {name: rel_diff(budget["weights"][name] - initial[name], fixed["weights"][name] - initial[name])
             for name in initial}
    print("token budget vs fixed micro-batches: rel diff of the whole update "
          f"{rel_diff(updates['budget'], updates['fixed']):.2e}; worst tensor {max(worst, key=worst.get)} "
          f"{max(worst.values()):.2e}")
    assert rel_diff(updates["budget"], updates["fixed"]) <= RTOL
    # Element-wise, an updated weight is also rounded to its own precision (eps |w| per rounding).
    weights = torch.cat([initial[name].flatten() for name in sorted(initial)])
    allowed = RTOL * updates["fixed"].abs().max() + 2 * torch.finfo(torch.float32).eps * weights.abs()
    assert ((updates["budget"] - updates["fixed"]).abs() <= allowed).all()


@pytest.mark.parametrize("use_kl_loss, kl_loss_coef, use_kl_in_reward, kl_coef, needed", [
    (False, 0.1, False, 0.1, False),
    (True, 0.1, False, 0.0, True),
    (True, 0.0, False, 0.0, False),
    (False, 0.0, True, 0.0, False),
    (False, 0.0, True, 0.05, True),
])
def test_reference_pass_only_when_a_kl_term_can_be_non_zero(use_kl_loss, kl_loss_coef, use_kl_in_reward, kl_coef,
                                                             needed):
    config = TrainConfig()
    config.actor.loss.use_kl_loss, config.actor.loss.kl_loss_coef = use_kl_loss, kl_loss_coef
    config.algorithm.use_kl_in_reward, config.algorithm.kl_ctrl.kl_coef = use_kl_in_reward, kl_coef
    assert uses_reference(config) is needed
