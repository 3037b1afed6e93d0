"""One SFT update and one DPO update at (TP, PP, DP) = (1,1,1), (2,1,1), (1,2,1), (1,1,2) give the same loss,
metrics, grad norm and updated weights: the losses are normalised by the global batch's loss tokens / pairs,
not per rank or micro-batch. fp32, dropout off; two torchrun launches (1 process, then 2 for three layouts)."""
import os
from pathlib import Path

import pytest
import torch

from verl_mega.parallel.launch import run_torchrun

pytestmark = pytest.mark.slow

LAUNCHES = {1: ["1,1"], 2: ["2,1", "1,2", "1,1"]}
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
# fp32 sums over a few hundred terms reordered by the layout: relative differences of a few 1e-7, well inside.
REL_TOL = 1e-5


def rel_diff(value, reference) -> float:
    value, reference = torch.as_tensor(value, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
    return ((value - reference).norm() / reference.norm().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("offline_roles")
    hf_dir = make_tiny_hf_model(root / "hf", "qwen2", num_hidden_layers=2)
    for tp, pp in {(tp, pp) for tp, pp, _ in LAYOUTS}:
        convert_hf_to_mcore(hf_dir, root / "ckpt" / f"tp{tp}pp{pp}", tp=tp, pp=pp)
    out = root / "out"
    out.mkdir()
    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": ":".join(filter(None, [tests_dir, *os.environ.get("PYTHONPATH", "").split(":")]))}
    for nproc, layouts in LAUNCHES.items():
        run_torchrun(nproc, "offline_roles_worker", [str(root / "ckpt"), str(out), *layouts], env=env)
    merged = {}
    for tp, pp, dp in LAYOUTS:
        stages = [torch.load(out / f"tp{tp}pp{pp}dp{dp}_stage{stage}.pt") for stage in range(pp)]
        last = stages[-1]
        for job in ("sft", "dpo"):
            last[f"{job}_weights"] = {name: tensor for stage in stages
                                      for name, tensor in stage[f"{job}_weights"].items()}
        merged[(tp, pp, dp)] = last
    return merged


@pytest.mark.parametrize("job", ["sft", "dpo"])
@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda layout: "tp{}pp{}dp{}".format(*layout))
def test_one_update_is_layout_invariant(results, layout, job):
    reference, result = results[(1, 1, 1)], results[layout]
    metrics = reference[f"{job}_metrics"]
    assert metrics["grad_norm"] > 0 and metrics["update_successful"] == 1.0
    for name, value in metrics.items():
        assert rel_diff(result[f"{job}_metrics"][name], value) <= REL_TOL, name
    weights = reference[f"{job}_weights"]
    assert result[f"{job}_weights"].keys() == weights.keys()
    worst = max(rel_diff(result[f"{job}_weights"][name], weights[name]) for name in weights)
    print(f"{job} {layout}: max rel diff of updated weights {worst:.2e}")
    assert worst <= REL_TOL


def test_dpo_metrics_at_the_initial_policy(results):
    """Policy = initial weights, reference shifted by linspace(-1, 1, 8): chosen rows 0,2,4,6 get shifts
    -1, -3/7, 1/7, 5/7 and rejected rows the next ones, so every margin is β·(-(-2/7)) = β·2/7 > 0."""
    metrics = results[(1, 1, 1)]["dpo_metrics"]
    assert metrics["rewards/margins"] == pytest.approx(0.5 * 2 / 7, rel=1e-5)
    assert metrics["rewards/accuracy"] == 1.0
    assert metrics["loss"] == pytest.approx(-torch.nn.functional.logsigmoid(torch.tensor(0.5 * 2 / 7)).item(),
                                            rel=1e-5)
