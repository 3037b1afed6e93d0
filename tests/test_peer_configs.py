"""Peers' published large-model configs (verl, slime), translated under tests/fixtures/model_configs/peers/, against
the memory planner: the answers docs/memory.md's peer table gives, so that a change to the planner that moves one
across the fit line shows here."""
from pathlib import Path

import pytest

from verl_mega.config import load_config
from verl_mega.planning.memory import Model, layout_of, plan_memory
from verl_mega.trainer.plan import roles_of

FIXTURES = Path(__file__).parent / "fixtures" / "model_configs"


@pytest.mark.parametrize("name, model, overrides, gpus, gpu_memory_gb, phase, peak_gb, fits", [
    ("verl_qwen2-7b_8xgpu", "qwen2.5-7b", [], 8, 80, "rollout", 72.8, True),
    # the reference's parameters wait on the host outside its own pass, as verl's ref param_offload keeps them
    ("verl_qwen2.5-32b_8xh20", "qwen2.5-32b", [], 8, 96, "actor.update", 88.4, True),
    ("verl_qwen2.5-32b_8xh20", "qwen2.5-32b", ["actor.offload.params=false"], 8, 96, "actor.update", 96.0, False),
    ("verl_qwen2.5-32b_8xh20", "qwen2.5-32b", [], 8, 80, "actor.update", 88.4, False),
    ("verl_qwen2-7b_8xgpu", "qwen2.5-7b", [], 8, 40, "rollout", 48.8, False),
    # rollout tp 4 over training tp 1 is not expressible here: planned at rollout tp 1
    ("verl_qwen3-30b-a3b_8x96gb", "qwen3-30b-a3b", ["parallel.rollout_tp=1"], 8, 96, "actor.update", 82.1, True),
    # ep 8 across tp 4 (megatron's expert-parallel folding) is not expressible here: planned at ep 2
    ("slime_qwen3-30b-a3b_8xgpu", "qwen3-30b-a3b", ["parallel.ep=2", "parallel.rollout_tp=4"], 8, 80, "rollout",
     63.5, True),
])
def test_peer_configs_plan_as_the_docs_say(name, model, overrides, gpus, gpu_memory_gb, phase, peak_gb, fits):
    config = load_config(FIXTURES / "peers" / f"{name}.yaml", [f"model.hf_path={FIXTURES / model}", *overrides])
    plan = plan_memory(Model(config), layout_of(config, gpus), roles_of(config), gpu_memory_gb)
    assert (plan.peak_phase, round(plan.max_memory_allocated_gb, 1), plan.fits) == (phase, peak_gb, fits)


def test_deepseek_v3_at_verls_layout_is_refused_with_the_reason():
    config = load_config(FIXTURES / "peers" / "verl_deepseek-v3_256xh100.yaml",
                         [f"model.hf_path={FIXTURES / 'deepseek-v3'}", "parallel.rollout_tp=1"])
    with pytest.raises(ValueError, match="must divide num_hidden_layers=61"):
        plan_memory(Model(config), layout_of(config, 256), roles_of(config), 80)
