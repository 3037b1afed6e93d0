"""One SFT update, one DPO update and one on-policy PPO update give the same loss, metrics, grad norm and updated
weights at every layout: the losses are normalised by the global batch's loss tokens / pairs, not per rank or
micro-batch. Dropout off.

- fp32, dense model: (TP, PP, DP) = (1,1,1) vs (2,1,1), (1,2,1), (1,1,2) and (2,2,2), within REL_TOL;
- fp32, tiny Mixtral and DeepSeek-V3 (whose router's expert bias megatron moves after the step): expert parallel
  EP=2 (DP=2, distributed optimizer) vs EP=1, within REL_TOL;
- fp32, tiny Qwen3-MoE (an MoE and a dense layer): (TP, PP, EP, DP) = (1,2,2,4) vs (1,1,1,1), within REL_TOL
  (megatron trains MoE at TP > 1 only with sequence parallelism, which verl_mega does not run);
- bf16, dense model: (2,1,1) vs (1,1,1), within what bf16 rounding explains (test_layout_invariance's bounds);
- fp32, tiny Mixtral, routing replay: a drawn routing replayed at TP=2, PP=2 and EP=2 gives the log-probs (and,
  except at TP=2, the PPO update with its router mismatch) of (1,1,1), and log-probs other than the model's own.
The distributed optimizer is on wherever DP > 1. The cases (tests/layout_grid.py's OFFLINE_LAUNCHES) run in the
three torchrun launches (1, 2 and 8 processes) shared with the role grid of tests/test_layout_invariance.py.
"""
import pytest
import torch

from layout_grid import DENSE, MLA, MOE, QWEN3_MOE
from tests.workers.offline_roles_worker import case_name

from .test_layout_invariance import BF16_AGGREGATE_TOL, REL_TOL, bf16_weight_tol, rel_diff

pytestmark = pytest.mark.slow

FP32_LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]  # (tp, pp, dp), each against (1,1,1)
BF16_LAYOUTS = [(1, 1, 1), (2, 1, 1)]
UPDATE_STEPS = 1  # optimizer steps per update (mini-batch = the whole batch)
JOBS = ("sft", "dpo", "ppo")
# bf16: the smooth aggregates (test_layout_invariance's BF16_AGGREGATE_TOL): the SFT loss (a token mean of
# log-probs), the grad norms, and the DPO log-probs of chosen / rejected (sums of log-probs). DPO's rewards and
# margins are differences of nearly equal policy and reference log-probs: no relative bound fits them.
BF16_COMPARED = {"sft": ("loss", "grad_norm"), "dpo": ("grad_norm", "logps/chosen", "logps/rejected")}


@pytest.fixture(scope="module")
def results(layout_grid):
    """case_name(...) -> that case's last-stage results, weights merged over the pipeline stages."""
    out = layout_grid / "offline" / "out"
    merged = {}
    for path in out.glob("*_stage0.pt"):
        name = path.name[:-len("_stage0.pt")]
        stages = sorted(out.glob(f"{name}_stage*.pt"))
        loaded = [torch.load(stage) for stage in stages]
        last = loaded[-1]
        for job in JOBS:
            last[f"{job}_weights"] = {key: tensor for stage in loaded
                                      for key, tensor in stage[f"{job}_weights"].items()}
        merged[name] = last
    for path in out.glob("*_replay.pt"):
        merged[path.stem] = torch.load(path)
    return merged


def compare_fp32(reference: dict, result: dict, job: str) -> None:
    metrics = reference[f"{job}_metrics"]
    assert metrics["grad_norm"] > 0 and metrics["update_successful"] == 1.0
    for name, value in metrics.items():
        assert rel_diff(result[f"{job}_metrics"][name], value) <= REL_TOL, name
    weights = reference[f"{job}_weights"]
    assert result[f"{job}_weights"].keys() == weights.keys()
    worst = max(rel_diff(result[f"{job}_weights"][name], weights[name]) for name in weights)
    print(f"{job}: max rel diff of updated weights {worst:.2e}")
    assert worst <= REL_TOL


@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("layout", FP32_LAYOUTS, ids=lambda layout: "tp{}pp{}dp{}".format(*layout))
def test_one_update_is_layout_invariant(results, layout, job):
    tp, pp, dp = layout
    compare_fp32(results[case_name(DENSE, "fp32", 1, 1, 1, 1)], results[case_name(DENSE, "fp32", tp, pp, 1, dp)],
                 job)


@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("model", [MOE, MLA])
def test_one_moe_update_is_expert_parallel_invariant(results, model, job):
    """Routing has no auxiliary loss and no token dropping here, so EP only moves where each expert runs."""
    reference, result = results[case_name(model, "fp32", 1, 1, 1, 1)], results[case_name(model, "fp32", 1, 1, 2, 2)]
    assert any(".experts." in name for name in reference[f"{job}_weights"])
    compare_fp32(reference, result, job)


@pytest.mark.parametrize("job", JOBS)
def test_one_qwen3_moe_update_is_invariant_over_pipeline_and_expert_parallel(results, job):
    """PP puts the MoE layer and the dense layer on two stages, EP halves the experts per rank, DP 4 splits the
    batch into one micro-batch per rank."""
    reference = results[case_name(QWEN3_MOE, "fp32", 1, 1, 1, 1)]
    result = results[case_name(QWEN3_MOE, "fp32", 1, 2, 2, 4)]
    assert any(".experts." in name for name in reference[f"{job}_weights"])
    assert any(".q_norm." in name for name in reference[f"{job}_weights"])
    compare_fp32(reference, result, job)


@pytest.mark.parametrize("job", ["sft", "dpo"])
def test_bf16_update_is_layout_invariant_within_bf16_rounding(results, job):
    (tp, pp, dp), (other_tp, other_pp, other_dp) = BF16_LAYOUTS
    reference = results[case_name(DENSE, "bf16", tp, pp, 1, dp)]
    result = results[case_name(DENSE, "bf16", other_tp, other_pp, 1, other_dp)]
    assert reference[f"{job}_metrics"]["update_successful"] == 1.0
    for name in BF16_COMPARED[job]:
        difference = rel_diff(result[f"{job}_metrics"][name], reference[f"{job}_metrics"][name])
        assert difference <= BF16_AGGREGATE_TOL, f"{name}: {difference:.2e} > {BF16_AGGREGATE_TOL:.2e}"
    weights = reference[f"{job}_weights"]
    assert result[f"{job}_weights"].keys() == weights.keys()
    worst = max((rel_diff(result[f"{job}_weights"][name], tensor) / bf16_weight_tol(tensor, UPDATE_STEPS), name)
                for name, tensor in weights.items())
    print(f"{job}: worst updated weight at {worst[0]:.2f} of its bf16 tolerance ({worst[1]})")
    assert worst[0] <= 1.0, worst[1]


def test_dpo_metrics_at_the_initial_policy(results):
    """Policy = initial weights, reference shifted by linspace(-1, 1, 8): chosen rows 0,2,4,6 get shifts
    -1, -3/7, 1/7, 5/7 and rejected rows the next ones, so every margin is β·(-(-2/7)) = β·2/7 > 0."""
    metrics = results[case_name(DENSE, "fp32", 1, 1, 1, 1)]["dpo_metrics"]
    assert metrics["rewards/margins"] == pytest.approx(0.5 * 2 / 7, rel=1e-5)
    assert metrics["rewards/accuracy"] == 1.0
    assert metrics["loss"] == pytest.approx(-torch.nn.functional.logsigmoid(torch.tensor(0.5 * 2 / 7)).item(),
                                            rel=1e-5)


@pytest.mark.parametrize("layout", [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 2)],
                         ids=lambda layout: "tp{}pp{}ep{}dp{}".format(*layout))
def test_routing_replay_is_layout_invariant(results, layout):
    """Every token goes to the drawn experts at any layout: micro-batches, pipeline stages and expert-parallel
    ranks each slice the routing as they slice the tokens."""
    reference = results[case_name(MOE, "fp32", 1, 1, 1, 1) + "_replay"]
    result = results[case_name(MOE, "fp32", *layout) + "_replay"]
    assert (reference["replayed"] - reference["natural"]).abs().max() > 1e-2, "the drawn routing changed nothing"
    for name in ("natural", "replayed"):
        assert rel_diff(result[name], reference[name]) <= REL_TOL, name
    # Drawn at random, most (token, layer) routings are not the router's own top-2 of 4 experts (5 in 6 expected).
    assert 0.5 < reference["update"]["router_mismatch"] <= 1.0
    if "update" in result:  # not at TP 2 (see offline_roles_worker.run_replay_case)
        for name, value in reference["update"].items():
            assert rel_diff(result["update"][name], value) <= REL_TOL, name
