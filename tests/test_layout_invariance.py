"""Actor, reference and critic under torchrun at (TP, PP, DP) = (1,1,1), (2,1,1), (1,2,1), (1,1,2), (2,2,2).

One fixed batch (left-padded prompts, right-padded responses), fp32, dropout off. Every layout must give
HF's log-probs, and the same PPO metrics, grad norm and updated weights as (1,1,1); the critic starts at
zero values and lowers its loss. Three torchrun launches: 1, 2 (three layouts in turn) and 8 processes.
"""
import os
from pathlib import Path

import pytest
import torch

from verl_mega.parallel.launch import run_torchrun

pytestmark = pytest.mark.slow

LAUNCHES = {1: ["1,1"], 2: ["2,1", "1,2", "1,1"], 8: ["2,2"]}
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)]
REL_TOL = 1e-5
ACTOR_METRICS = ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss", "grad_norm")


def rel_diff(value, reference) -> float:
    value, reference = torch.as_tensor(value, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
    return ((value - reference).norm() / reference.norm().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """(tp, pp, dp) -> the last stage's saved results, with `weights` merged over the pipeline stages."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("roles")
    hf_dir = make_tiny_hf_model(root / "hf", "qwen2", num_hidden_layers=2)
    for tp, pp in {(tp, pp) for tp, pp, _ in LAYOUTS}:
        convert_hf_to_mcore(hf_dir, root / "ckpt" / f"tp{tp}pp{pp}", tp=tp, pp=pp)
    out = root / "out"
    out.mkdir()
    tests_dir = str(Path(__file__).parent)
    # roles_worker lives next to this file; the rest of PYTHONPATH keeps this checkout's verl_mega first.
    env = {"PYTHONPATH": ":".join(filter(None, [tests_dir, *os.environ.get("PYTHONPATH", "").split(":")]))}
    for nproc, layouts in LAUNCHES.items():
        run_torchrun(nproc, "roles_worker", [str(root / "ckpt"), str(hf_dir), str(out), *layouts], env=env)
    merged = {}
    for tp, pp, dp in LAYOUTS:
        stages = [torch.load(out / f"tp{tp}pp{pp}dp{dp}_stage{stage}.pt") for stage in range(pp)]
        last = stages[-1]
        last["weights"] = {name: tensor for stage in stages for name, tensor in stage["weights"].items()}
        merged[(tp, pp, dp)] = last
    merged["hf_dir"] = hf_dir
    return merged


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "tp{}pp{}dp{}".format(*layout))
def test_log_probs_match_hf_on_left_padded_inputs(results, layout):
    result = results[layout]
    mask = result["response_mask"].bool()
    for name in ("log_probs", "ref_log_prob"):
        torch.testing.assert_close(result[name][mask], result["hf_log_probs"][mask], rtol=0, atol=1e-5)
    assert torch.isfinite(result["entropy"]).all()


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda layout: "tp{}pp{}dp{}".format(*layout))
def test_ppo_update_is_layout_invariant(results, layout):
    reference, result = results[(1, 1, 1)], results[layout]
    for name in ACTOR_METRICS:
        assert rel_diff(result["actor_metrics"][name], reference["actor_metrics"][name]) <= REL_TOL, name
    assert result["weights"].keys() == reference["weights"].keys()
    worst = max(rel_diff(result["weights"][name], reference["weights"][name]) for name in reference["weights"])
    print(f"{layout}: max rel diff of updated weights {worst:.2e}")
    assert worst <= REL_TOL
    for before, after in zip(reference["critic_metrics"], result["critic_metrics"]):
        assert rel_diff(after["vf_loss"], before["vf_loss"]) <= REL_TOL


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
