"""The actor's update does not depend on which passes computed its inputs, nor on how rows are grouped into
micro-batches (tests/update_passes_worker.py under torchrun, 2 processes, tiny Qwen2, fp32).

- The reference pass runs only when a KL term can be non-zero (fast, config only).
- Old log-probs taken from the update's first forward (one epoch over one mini-batch) give bitwise the same
  weights and metrics as a separate forward pass.
"""
import os
from pathlib import Path

import pytest
import torch

from verl_mega.config import TrainConfig
from verl_mega.parallel.launch import run_torchrun
from verl_mega.trainer.ppo import needs_reference

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("passes")
    hf_dir = make_tiny_hf_model(root / "hf", "qwen2", num_hidden_layers=2)
    convert_hf_to_mcore(hf_dir, root / "ckpt" / "tp2pp1", tp=2, pp=1)
    out = root / "out"
    out.mkdir()
    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": ":".join(filter(None, [tests_dir, *os.environ.get("PYTHONPATH", "").split(":")]))}
    run_torchrun(2, "update_passes_worker", [str(root / "ckpt"), str(out)], env=env)
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


@pytest.mark.slow
def test_old_log_probs_from_the_first_forward_give_the_same_update(results):
    separate, first_forward = results["skip_old_pass"]["separate_pass"], results["skip_old_pass"]["first_forward"]
    assert first_forward["metrics"] == separate["metrics"]
    assert first_forward["weights"].keys() == separate["weights"].keys()
    for name, tensor in separate["weights"].items():
        assert torch.equal(first_forward["weights"][name], tensor), name


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
    assert needs_reference(config) is needed
