"""Training-state checkpoints of the actor and critic (verl_mega.run.training_state).

Two torchrun launches of 8 processes on a 2-layer qwen2 with tied embeddings, for the plain and the
distributed optimizer, and LoRA adapters on both roles (distributed optimizer; the adapters and their Adam state
are all the state holds): the first runs update A at (TP, PP, DP) = (2, 2, 2), saves, runs update B; the second
(a fresh process) loads the saved state at (2, 2, 2), (2, 1, 4) and (1, 2, 4) and runs update B. At the
saving layout the resumed update must match bitwise; at the others, within REL_TOL. The first is a case of the
layout grids' 8-process launch (tests/layout_grid.py), on the role grid's model and checkpoints.
"""
import os
from pathlib import Path

import pytest
import torch

from verl_mega.parallel.spawn import run_torchrun

from layout_grid import SHARED_CASES

SAVE_LAYOUT = (2, 2)
OTHER_LAYOUTS = [(2, 1), (1, 2)]
KINDS = ("plain", "distributed", "lora")
REL_TOL = 1e-5


def rel_diff(value, reference) -> float:
    value, reference = torch.as_tensor(value, dtype=torch.float64), torch.as_tensor(reference, dtype=torch.float64)
    return ((value - reference).norm() / reference.norm().clamp_min(1e-12)).item()


def merged_stages(out: Path, name: str, pp: int) -> dict:
    stages = [torch.load(out / f"{name}_stage{stage}.pt") for stage in range(pp)]
    last = stages[-1]
    for role in ("actor_weights", "critic_weights"):
        last[role] = {name: tensor for stage in stages for name, tensor in stage[role].items()}
    return last


@pytest.fixture(scope="module")
def runs(layout_grid):
    """'uninterrupted' and (tp, pp) -> kind -> {actor_metrics, critic_metrics, actor_weights, critic_weights}."""
    ckpt_root, out = layout_grid / "roles" / "ckpt", layout_grid / "state"
    assert _tied(layout_grid / "roles" / "hf")
    assert "state_save:{},{}".format(*SAVE_LAYOUT) in SHARED_CASES[8], "the grid saves at SAVE_LAYOUT"
    assert all((ckpt_root / f"tp{tp}pp{pp}").is_dir() for tp, pp in OTHER_LAYOUTS), "the role grid converts them"
    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": ":".join(filter(None, [tests_dir, str(Path(tests_dir).parent),
                                                      *os.environ.get("PYTHONPATH", "").split(":")]))}
    layouts = [f"{tp},{pp}" for tp, pp in [SAVE_LAYOUT, *OTHER_LAYOUTS]]
    run_torchrun(8, "tests.workers.training_state_worker", ["resume", str(ckpt_root), str(out), *layouts], env=env)
    results = {"uninterrupted": {kind: merged_stages(out, f"uninterrupted_{kind}", SAVE_LAYOUT[1]) for kind in KINDS},
               **{name: torch.load(out / f"{name}.pt")
                  for name in ("wrong_model_refusal", "distributed_kind_refusal", "lora_kind_refusal")}}
    for tp, pp in [SAVE_LAYOUT, *OTHER_LAYOUTS]:
        results[(tp, pp)] = {kind: merged_stages(out, f"resumed_tp{tp}pp{pp}_{kind}", pp) for kind in KINDS}
    return results


def _tied(hf_dir: Path) -> bool:
    import json

    return json.loads((hf_dir / "config.json").read_text()).get("tie_word_embeddings", False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_resume_at_the_same_layout_is_bitwise_exact(runs, kind):
    uninterrupted, resumed = runs["uninterrupted"][kind], runs[SAVE_LAYOUT][kind]
    assert resumed["actor_metrics"] == uninterrupted["actor_metrics"]
    assert resumed["critic_metrics"] == uninterrupted["critic_metrics"]
    for role in ("actor_weights", "critic_weights"):
        assert resumed[role].keys() == uninterrupted[role].keys()
        unequal = [name for name in uninterrupted[role] if not torch.equal(resumed[role][name], uninterrupted[role][name])]
        assert not unequal, f"{role}: {unequal}"
    assert "value_head.weight" in resumed["critic_weights"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", OTHER_LAYOUTS, ids=lambda layout: "tp{}pp{}dp4".format(*layout))
def test_resume_at_another_layout_continues_the_run(runs, kind, layout):
    uninterrupted, resumed = runs["uninterrupted"][kind], runs[layout][kind]
    for metrics in ("actor_metrics", "critic_metrics"):
        for name, value in uninterrupted[metrics].items():
            assert rel_diff(resumed[metrics][name], value) <= REL_TOL, f"{metrics}[{name}]"
    for role in ("actor_weights", "critic_weights"):
        assert resumed[role].keys() == uninterrupted[role].keys()
        worst = max(rel_diff(resumed[role][name], uninterrupted[role][name]) for name in uninterrupted[role])
        print(f"{kind} {layout} {role}: max rel diff {worst:.2e}")
        assert worst <= REL_TOL, role


@pytest.mark.slow
def test_state_of_another_model_is_refused(runs):
    assert "was written for another model: tensor 'output_layer.weight'" in runs["wrong_model_refusal"]


@pytest.mark.slow
def test_lora_and_full_parameter_states_refuse_each_other(runs):
    assert "holds LoRA adapters (rank 4 on linear_fc1,linear_fc2,linear_proj,linear_qkv) but this job trains every " \
           "parameter: resume with actor.lora.rank=4" in runs["distributed_kind_refusal"]
    assert "was saved by a run that trains every parameter, but this job trains LoRA adapters (actor.lora.rank=4)" \
           in runs["lora_kind_refusal"]


@pytest.mark.slow
def test_lora_state_holds_the_adapters_not_the_frozen_base(layout_grid):
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_tensors_metadata(str(layout_grid / "state" / "state" / "lora" / "actor"))
    weights = [key for key in stored if not key.startswith("optimizer.")]
    assert weights and all(key.endswith((".lora_a", ".lora_b")) for key in weights), weights
    assert stored["decoder.layers.mlp.linear_fc1.lora_b"].global_shape[1:] == (256, 4)  # TP-merged, gate|up


def test_incomplete_checkpoint_is_refused(tmp_path):
    from verl_mega.run.training_state import load_training_state

    (tmp_path / "__0_0.distcp").write_bytes(b"")  # shard files written, metadata.json not yet
    with pytest.raises(FileNotFoundError, match="not a complete training-state checkpoint"):
        load_training_state(trainable=None, directory=tmp_path)
