"""Offload across the colocated rollout window (`actor.offload`, `rollout.training_memory`) and megatron's optimizer
CPU offload (`actor.optim.cpu_offload`), on CPU, where the device is the host: the seams.

- what each setting moves: the gradient buffers, Adam's state, the parameters with the fp32 main parameters, each
  storage resized to nothing while away and every tensor object kept;
- everything is back bitwise, and training after a window with everything offloaded takes the steps that training
  without it takes, bitwise (fp32, and bf16 with the distributed optimizer's fp32 main-parameter shards);
- the parameters leave only when the body says the engine holds its copy (the call order is in test_rl_generation);
- `optim.cpu_offload` reaches megatron's OptimizerConfig as the whole optimizer on the host (the pre-flight check
  refuses it without CUDA, and CP and VPP, in test_recompute).
"""
from __future__ import annotations

import pytest
import torch

from verl_mega.config import OptimConfig
from verl_mega.config.schema import OffloadConfig

SETTINGS = {"fp32": dict(dtype="fp32", distributed=False), "bf16_distributed": dict(dtype="bf16", distributed=True)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_models):
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore

    folder = tmp_path_factory.mktemp("offload") / "mcore"
    convert_hf_to_mcore(tiny_models["qwen2"], folder)
    return folder


def trainable(checkpoint, dtype: str, distributed: bool):
    from verl_mega.checkpoint.model_io import build_model_from_checkpoint
    from verl_mega.roles.trainable import TrainableModel

    module, *_ = build_model_from_checkpoint(checkpoint, dtype=dtype)
    optim = OptimConfig(lr=1e-2, use_distributed_optimizer=distributed)
    return TrainableModel(module, optim, schedule_steps=4)


def train_step(model, seed: int) -> None:
    from verl_mega.roles.batching import causal_padding_mask

    ids = torch.randint(1, 250, (2, 16), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(16).expand(2, -1)
    model.model.train()
    loss = model.model(ids, positions, causal_padding_mask(torch.ones_like(ids))).float().log_softmax(-1).mean()
    loss.backward()
    model.step()


def optimizer_state(model) -> list[torch.Tensor]:
    from verl_mega.rollout.training_memory import _optimizer_state_tensors

    return list(_optimizer_state_tensors(model.optimizer))


def main_parameters(model) -> list[torch.Tensor]:
    from verl_mega.rollout.training_memory import _main_parameters

    return list(_main_parameters(model.optimizer))


def snapshot(tensors) -> list[torch.Tensor]:
    return [tensor.detach().clone() for tensor in tensors]


def assert_bitwise(tensors, expected) -> None:
    assert len(tensors) == len(expected)
    for tensor, value in zip(tensors, expected):
        assert tensor.dtype == value.dtype and torch.equal(tensor, value)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_part_leaves_as_a_resized_storage_and_comes_back_bitwise(one_rank, checkpoint, setting):
    from verl_mega.rollout.training_memory import _megatron_grad_buffers, training_memory_released

    model = trainable(checkpoint, **SETTINGS[setting])
    train_step(model, 0)
    params, states, mains = list(model.model.parameters()), optimizer_state(model), main_parameters(model)
    assert states and mains
    grads = [buffer.grad_data for buffer in _megatron_grad_buffers(model.model)]
    before = {"params": snapshot(params), "states": snapshot(states), "mains": snapshot(mains)}
    with training_memory_released(model.model, model.optimizer, OffloadConfig(True, True, True)) as release_params:
        assert all(grad.untyped_storage().nbytes() == 0 for grad in grads)
        assert all(state.untyped_storage().nbytes() == 0 for state in states)
        assert all(param.grad is None for param in params)
        # The engine still reads the parameters: they stay until it says it holds its copy.
        assert_bitwise(params, before["params"])
        release_params()
        assert all(param.untyped_storage().nbytes() == 0 for param in params)
        assert all(main.untyped_storage().nbytes() == 0 for main in mains)
    assert list(model.model.parameters()) == params and optimizer_state(model) == states  # the same tensors
    assert_bitwise(params, before["params"])
    assert_bitwise(states, before["states"])
    assert_bitwise(mains, before["mains"])
    assert all(grad.untyped_storage().nbytes() > 0 and not grad.any() for grad in grads)


def test_only_the_named_parts_leave(one_rank, checkpoint):
    from verl_mega.rollout.training_memory import _megatron_grad_buffers, training_memory_released

    model = trainable(checkpoint, "fp32", False)
    train_step(model, 0)
    params, states = list(model.model.parameters()), optimizer_state(model)
    grads = [buffer.grad_data for buffer in _megatron_grad_buffers(model.model)]
    with training_memory_released(model.model, model.optimizer, OffloadConfig(False, False, True)) as release_params:
        release_params()
        assert all(state.untyped_storage().nbytes() == 0 for state in states)
        assert all(tensor.untyped_storage().nbytes() > 0 for tensor in [*params, *grads])
    with training_memory_released(model.model, model.optimizer, OffloadConfig(False, False, False)) as release_params:
        release_params()
        assert all(tensor.untyped_storage().nbytes() > 0 for tensor in [*params, *grads, *states])


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_training_after_offload_takes_the_steps_training_without_it_takes(one_rank, checkpoint, setting):
    from verl_mega.rollout.training_memory import training_memory_released

    plain, offloaded = trainable(checkpoint, **SETTINGS[setting]), trainable(checkpoint, **SETTINGS[setting])
    for step in range(3):
        train_step(plain, step)
        train_step(offloaded, step)
        with training_memory_released(offloaded.model, offloaded.optimizer, OffloadConfig(True, True, True)) as release:
            release()
    assert_bitwise(list(offloaded.model.parameters()), snapshot(plain.model.parameters()))
    assert_bitwise(optimizer_state(offloaded), snapshot(optimizer_state(plain)))


def test_the_critic_leaves_with_the_actor_and_comes_back_bitwise(one_rank, checkpoint):
    """models_memory_released over the actor (everything) and a critic-like trained model (its gradients and
    Adam's state only), as `Models.idle_in_rollout` names them: each leaves as its offload says, the parameters only
    at `release_params`, and all come back bitwise."""
    from verl_mega.rollout.training_memory import _megatron_grad_buffers, models_memory_released

    actor, critic = trainable(checkpoint, "fp32", False), trainable(checkpoint, "bf16", True)
    train_step(actor, 0)
    train_step(critic, 1)
    critic_params, critic_states = list(critic.model.parameters()), optimizer_state(critic)
    critic_grads = [buffer.grad_data for buffer in _megatron_grad_buffers(critic.model)]
    before = snapshot([*critic_params, *critic_states])
    held = [(actor.model, actor.optimizer, OffloadConfig(True, True, True)),
            (critic.model, critic.optimizer, OffloadConfig(False, True, True))]
    with models_memory_released(held) as release_params:
        assert all(tensor.untyped_storage().nbytes() == 0 for tensor in [*critic_grads, *critic_states])
        assert all(param.untyped_storage().nbytes() > 0 for param in critic_params)
        release_params()
        assert all(param.untyped_storage().nbytes() == 0 for param in actor.model.parameters())
        assert all(param.untyped_storage().nbytes() > 0 for param in critic_params)
    assert_bitwise([*critic_params, *critic_states], before)
    assert all(grad.untyped_storage().nbytes() > 0 and not grad.any() for grad in critic_grads)


def test_an_offloaded_reference_is_on_the_device_in_its_own_pass_only(one_rank, checkpoint):
    """`Reference(offload_params=True)` (the actor's `actor.offload.params`, verl's ref param_offload): its weights
    are resized to nothing from the start, come back for `compute_ref_log_prob` (the same log-probs, bitwise, as a
    reference kept on the device) and leave again after, every tensor object kept."""
    from tests.test_lora import tiny_batch
    from verl_mega.roles.reference import Reference

    kept, offloaded = Reference(checkpoint), Reference(checkpoint, offload_params=True)
    params = list(offloaded.model.parameters())
    assert params and all(param.untyped_storage().nbytes() == 0 for param in params)
    with offloaded.on_device():
        seen = [param.untyped_storage().nbytes() for param in params]
    assert all(seen)
    batch = tiny_batch()
    assert torch.equal(offloaded.compute_ref_log_prob(batch, 4), kept.compute_ref_log_prob(batch, 4))
    assert list(offloaded.model.parameters()) == params
    assert all(param.untyped_storage().nbytes() == 0 for param in params)
    assert offloaded.host.nbytes == sum(param.untyped_storage().size() for param in kept.model.parameters())


def test_cpu_offload_reaches_megatron_as_the_whole_optimizer_on_the_host(one_rank, checkpoint):
    from verl_mega.checkpoint.model_io import build_model_from_checkpoint
    from verl_mega.roles.trainable import optimizer_config

    module, *_ = build_model_from_checkpoint(checkpoint)
    offloaded = optimizer_config(OptimConfig(use_distributed_optimizer=True, cpu_offload=True), module.config)
    assert offloaded.optimizer_cpu_offload and offloaded.optimizer_offload_fraction == 1.0
    plain = optimizer_config(OptimConfig(), module.config)
    assert not plain.optimizer_cpu_offload and plain.optimizer_offload_fraction == 0.0


def test_preflight_accepts_offload_across_the_rollout_window(tiny_models, prompt_file):
    from verl_mega.config import load_config
    from verl_mega.trainer.preflight import preflight_check

    preflight_check(load_config(None, [
        f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]", "data.batch_size=4",
        "actor.mini_batch_size=4", "critic.mini_batch_size=4", "actor.offload.params=true",
        "actor.offload.grads=false"]), world_size=1)


@pytest.mark.slow
def test_an_rl_run_with_everything_offloaded_logs_the_run_without_offload(tmp_path):
    """The trainer's rollout window (PPO with a critic, the embedded engine): the actor's and the critic's parameters
    leave after the engine loaded its copy and come back for the update; every logged figure is the plain run's."""
    from tests.trainer_runs import make_inputs, records, run, train_command

    setup = make_inputs(tmp_path)
    logged = {}
    for name, offload in (("plain", "false"), ("offloaded", "true")):
        run(train_command(setup, tmp_path / name, 1, "trainer.total_steps=2", "parallel.tp=1", "parallel.pp=1",
                          "parallel.rollout_tp=1",
                          f"actor.offload.params={offload}", f"actor.offload.grads={offload}",
                          f"actor.offload.optimizer={offload}", f"critic.offload.params={offload}",
                          f"critic.offload.grads={offload}", f"critic.offload.optimizer={offload}"))
        logged[name] = records(tmp_path / name)
    assert len(logged["plain"]) == 2 and logged["offloaded"] == logged["plain"]
