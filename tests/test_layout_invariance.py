"""Actor, reference and critic under torchrun at (TP, PP, DP) = (1,1,1), (2,1,1), (1,2,1), (1,1,2), (2,2,2).

One fixed batch (left-padded prompts, right-padded responses), dropout off. In fp32 every layout must give
HF's log-probs, and the same PPO metrics, grad norm and updated weights as (1,1,1); the critic starts at
zero values and lowers its loss. In bf16 the same update agrees within what bf16 rounding explains (see
BF16_* below). Both dtypes run in the three torchrun launches (1, 2: three layouts in turn, and 8 processes)
that tests/layout_grid.py shares with the offline grid; in fp32 the (1,1,1) and (2,2,2) layouts also train one
actor per further policy loss (gspo, cispo, ...) and compare them.
"""
from pathlib import Path

import pytest
import torch

from verl_mega.converters.parity import ROUNDING_SITES

from tests.workers.roles_worker import CORRECTION_CASES, POLICY_LOSS_CASES

pytestmark = pytest.mark.slow

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]
REL_TOL = 1e-5
LOGPROB_ATOL = 1e-5  # every layout's log-probs equal transformers' within this (fp32)
ACTOR_METRICS = ("pg_loss", "pg_clipfrac", "entropy", "kl_loss", "grad_norm")
# ppo_kl is the mean of (old - new) log-probs over tokens, a difference whose value (~2.6e-3 here) is far smaller
# than its terms, so a relative bound does not fit it: its error is bounded absolutely, by the log-probs'. Both
# layouts are within LOGPROB_ATOL of transformers', so their ppo_kl differ by at most 2 * LOGPROB_ATOL (the
# later mini-batches' weights differ by ~1e-8 relative, which adds nothing measurable).

# bf16: layouts split the matmuls over TP (each rank's partial product rounded to bf16 before the reduction)
# and the batch over DP and micro-batches, so activations and gradients differ between layouts by rounding.
# - Activations and gradients: relative error of about u * sqrt(2 * S * (L + 1)) (u = 2^-8, bf16's 8 significant
#   bits; S rounding sites per layer as in converters.parity, twice for forward and backward; L = 2 layers);
#   3 sigma of that bounds the relative difference of the smooth aggregates compared (entropy, grad norm,
#   value loss).
# - Weights are stored in bf16, rounded from the fp32 main weights; two main weights closer than one ulp
#   round at most one ulp apart, and one ulp is at most 2^-7 of the value. With Adam's eps 1e-2 the update's
#   sensitivity to the gradient is below lr per unit of relative gradient error, so each of the update's
#   optimizer steps adds at most lr * 3 sigma, relative to the tensor's RMS.
BF16_U = 2.0**-8
BF16_SIGMA = BF16_U * (2 * ROUNDING_SITES * (2 + 1)) ** 0.5
BF16_AGGREGATE_TOL = 3 * BF16_SIGMA
BF16_STEPS, BF16_LR = 2, 1e-2  # optimizer steps of roles_worker's update (BATCH / MINI_BATCH) and its lr
BF16_SMOOTH_METRICS = ("entropy", "grad_norm")


def bf16_weight_tol(reference: torch.Tensor, steps: int = BF16_STEPS) -> float:
    """The relative difference a bf16 weight may show after `steps` optimizer steps at BF16_LR (see above)."""
    rms = reference.double().pow(2).mean().sqrt().item()
    return 2.0**-7 + steps * BF16_LR * BF16_AGGREGATE_TOL / rms


def rel_diff(value, reference) -> float:
    value, reference = torch.as_tensor(value, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
    return ((value - reference).norm() / reference.norm().clamp_min(1e-12)).item()


def role_results(grid: Path, dtype: str) -> dict:
    """(tp, pp, dp) -> the last stage's saved results in `dtype`, with `weights` (and each further policy loss's)
    merged over the pipeline stages."""
    out = grid / "roles" / f"out_{dtype}"
    merged = {}
    for tp, pp, dp in LAYOUTS:
        stages = [torch.load(out / f"tp{tp}pp{pp}dp{dp}_stage{stage}.pt") for stage in range(pp)]
        last = stages[-1]
        last["weights"] = {name: tensor for stage in stages for name, tensor in stage["weights"].items()}
        for loss, update in last["loss_updates"].items():
            update["weights"] = {name: tensor for stage in stages
                                 for name, tensor in stage["loss_updates"][loss]["weights"].items()}
        merged[(tp, pp, dp)] = last
    merged["hf_dir"] = grid / "roles" / "hf"
    return merged


@pytest.fixture(scope="module")
def results(layout_grid):
    return role_results(layout_grid, "fp32")


@pytest.fixture(scope="module")
def bf16_results(layout_grid):
    return role_results(layout_grid, "bf16")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "tp{}pp{}dp{}".format(*layout))
def test_log_probs_match_hf_on_left_padded_inputs(results, layout):
    result = results[layout]
    mask = result["response_mask"].bool()
    for name in ("log_probs", "ref_log_probs"):
        torch.testing.assert_close(result[name][mask], result["hf_log_probs"][mask], rtol=0, atol=LOGPROB_ATOL)
    assert torch.isfinite(result["entropy"]).all()


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda layout: "tp{}pp{}dp{}".format(*layout))
def test_ppo_update_is_layout_invariant(results, layout):
    reference, result = results[(1, 1, 1)], results[layout]
    for name in ACTOR_METRICS:
        assert rel_diff(result["actor_metrics"][name], reference["actor_metrics"][name]) <= REL_TOL, name
    assert abs(result["actor_metrics"]["ppo_kl"] - reference["actor_metrics"]["ppo_kl"]) <= 2 * LOGPROB_ATOL
    assert result["weights"].keys() == reference["weights"].keys()
    worst = max(rel_diff(result["weights"][name], reference["weights"][name]) for name in reference["weights"])
    print(f"{layout}: max rel diff of updated weights {worst:.2e}")
    assert worst <= REL_TOL
    for before, after in zip(reference["critic_metrics"], result["critic_metrics"]):
        assert rel_diff(after["vf_loss"], before["vf_loss"]) <= REL_TOL


@pytest.mark.parametrize("loss", sorted(POLICY_LOSS_CASES) + sorted(CORRECTION_CASES))
def test_each_policy_loss_update_is_layout_invariant(results, loss):
    """(2,2,2) against (1,1,1): DP slices, TP shards and pipeline stages; clip_cov and kl_cov select within the
    same micro-batches, gpg (Dr. GRPO's constant norm) is cut into other micro-batches, and the rollout
    correction's weights and rejection act on the vanilla loss (roles_worker)."""
    reference, result = (results[layout]["loss_updates"][loss] for layout in [(1, 1, 1), (2, 2, 2)])
    assert result["metrics"].keys() == reference["metrics"].keys()
    print(f"{loss}: {reference['metrics']}")
    # The case's knobs make it clip (or cut) something on this batch, so the comparison covers that path.
    assert reference["metrics"].get("pg_clipfrac", 1.0) > 0
    for name, value in reference["metrics"].items():
        if name.startswith("ppo_kl"):  # differences of log-probs: bounded absolutely (see ppo_kl above)
            assert abs(result["metrics"][name] - value) <= 2 * LOGPROB_ATOL, name
        else:
            assert rel_diff(result["metrics"][name], value) <= REL_TOL, name
    worst = max(rel_diff(result["weights"][name], tensor) for name, tensor in reference["weights"].items())
    print(f"{loss}: max rel diff of updated weights {worst:.2e}")
    assert worst <= REL_TOL


def test_update_changes_every_weight(results):
    from safetensors.torch import load_file

    initial = load_file(Path(results["hf_dir"]) / "model.safetensors")
    updated = results[(1, 1, 1)]["weights"]
    assert updated.keys() == initial.keys()
    assert all(not torch.equal(updated[name], initial[name]) for name in initial)


@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 2, 2)], ids=lambda layout: "tp{}pp{}dp{}".format(*layout))
def test_critic_starts_at_zero_and_lowers_value_loss(results, layout):
    result = results[layout]
    assert result["initial_values"].shape == result["response_mask"].shape
    assert torch.count_nonzero(result["initial_values"]) == 0
    losses = [step["vf_loss"] for step in result["critic_metrics"]]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda layout: "tp{}pp{}dp{}".format(*layout))
def test_bf16_ppo_update_is_layout_invariant_within_bf16_rounding(bf16_results, layout):
    reference, result = bf16_results[(1, 1, 1)], bf16_results[layout]
    assert_within_bf16_rounding(result, reference, "actor_metrics", layout)


def assert_within_bf16_rounding(result: dict, reference: dict, actor_metrics: str, label) -> None:
    """A bf16 update at one layout against the same at (1, 1, 1): the actor's smooth metrics (under the key
    `actor_metrics`), the critic's value losses and every updated weight within the bf16 bounds above."""
    for name in BF16_SMOOTH_METRICS:
        difference = rel_diff(result[actor_metrics][name], reference[actor_metrics][name])
        assert difference <= BF16_AGGREGATE_TOL, f"{name}: {difference:.2e} > {BF16_AGGREGATE_TOL:.2e}"
    for before, after in zip(reference["critic_metrics"], result["critic_metrics"]):
        assert rel_diff(after["vf_loss"], before["vf_loss"]) <= BF16_AGGREGATE_TOL
    assert result["weights"].keys() == reference["weights"].keys()
    worst = max((rel_diff(result["weights"][name], tensor) / bf16_weight_tol(tensor), name)
                for name, tensor in reference["weights"].items())
    print(f"{label}: worst updated weight at {worst[0]:.2f} of its bf16 tolerance ({worst[1]})")
    assert worst[0] <= 1.0, worst[1]
