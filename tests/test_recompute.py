"""Activation recompute and sequence parallelism change what the forward keeps for the backward, never a result:

- recompute full (uniform, block) and selective give none's loss and gradients, and full keeps less activation
  memory (LiveBytes) at a longer sequence;
- routing replay reaches the forward that full recompute runs again in the backward;
- sequence parallelism at TP 2 gives the losses and gradients of TP 2 without it (actor, critic, a replayed MoE
  actor), its micro-batches padded to a multiple of TP columns;
- the pre-flight check refuses in one line the memory settings that cannot run (also CP, VPP and the optimizer's
  CPU offload without CUDA).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from verl_mega.roles.batching import micro_batches, pad_columns_to_multiple
from verl_mega.roles.routing_replay import NOT_RECORDED

RECOMPUTE = {
    "none": {},
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model -> a tiny model of 3 layers converted at TP 1 (qwen2 dense; mixtral MoE for routing replay)."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("recompute")
    ckpts = {}
    for model in ("qwen2", "mixtral"):
        hf_dir = make_tiny_hf_model(root / "hf" / model, model, num_hidden_layers=3)
        convert_hf_to_mcore(hf_dir, root / model, tp=1, pp=1, ep=1)
        ckpts[model] = root / model
    return ckpts


def loss_and_grads(ckpt: Path, length: int, **overrides) -> tuple[float, dict[str, torch.Tensor], int]:
    """One training forward and backward of the bare model on 2 random rows of `length` tokens: the loss, the
    gradients, and the activation bytes the forward kept (LiveBytes' peak over forward and backward)."""
    from verl_mega.checkpoint.model_io import build_model_from_checkpoint
    from verl_mega.roles.batching import causal_padding_mask
    from verl_mega.rollout.live_bytes import LiveBytes

    model, *_ = build_model_from_checkpoint(ckpt, **overrides)
    model.train()
    ids = torch.randint(1, 250, (2, length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length).expand(2, -1)
    mask = causal_padding_mask(torch.ones_like(ids))
    with LiveBytes() as tracked:
        loss = model(ids, positions, mask).float().log_softmax(-1).mean()
        loss.backward()
    return loss.item(), {name: param.grad for name, param in model.named_parameters()}, tracked.peak


@pytest.mark.parametrize("setting", ["full_uniform", "full_block", "selective"])
def test_recompute_gives_the_loss_and_gradients_of_none(one_rank, checkpoints, setting):
    loss, grads, _ = loss_and_grads(checkpoints["qwen2"], 32)
    recomputed_loss, recomputed_grads, _ = loss_and_grads(checkpoints["qwen2"], 32, **RECOMPUTE[setting])
    assert recomputed_loss == pytest.approx(loss, abs=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(recomputed_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_full_recompute_keeps_less_activation_memory(one_rank, checkpoints):
    peaks = {setting: loss_and_grads(checkpoints["qwen2"], 512, **RECOMPUTE[setting])[2]
             for setting in ("none", "full_uniform", "selective")}
    ratio = peaks["full_uniform"] / peaks["none"]
    print(f"LiveBytes peak over forward+backward, 3 layers x 512 tokens: {peaks}; full/none = {ratio:.2f}")
    assert ratio < 0.8
    assert peaks["selective"] < peaks["none"]


def test_replayed_routes_reach_the_recomputed_forward(one_rank, checkpoints):
    """Random routes, which the router would not choose: replayed in the first forward only, the recompute's
    gradients would be the router's own routing's."""
    from verl_mega.config import OptimConfig
    from verl_mega.models.builder import unwrap_model
    from verl_mega.roles.actor import Actor, response_logprobs
    from verl_mega.roles.megatron_step import forward_backward
    from verl_mega.roles.routing_replay import ROUTED_EXPERTS, _routes_of
    from tests.workers.roles_worker import fixed_batch
    from tests.workers.sequence_parallel_worker import replayed_routes

    results = {}
    for setting in ("none", "full_uniform"):
        actor = Actor(checkpoints["mixtral"], OptimConfig(), schedule_steps=1, router_replay="rollout",
                      **RECOMPUTE[setting])
        batch = fixed_batch(actor.vocab_size, 0)
        config = unwrap_model(actor.model).config
        batch[ROUTED_EXPERTS] = replayed_routes(batch, 3, config.moe_router_topk, config.num_moe_experts)

        def loss_fn(output, micro_batch, share):
            mask = micro_batch["response_mask"]
            loss = (response_logprobs(output, micro_batch, actor.vocab_size, False) * mask).sum() * share.loss
            return loss, {"loss": loss}

        actor.model.train()
        loss = forward_backward(actor.model, batch, 2, "token-mean", ["loss"], loss_fn)["loss"]
        assert all(not router.kept_for_recompute for router in _routes_of(actor.model))
        results[setting] = loss, {name: param.main_grad.clone() for name, param in actor.model.named_parameters()}
    (loss, grads), (recomputed_loss, recomputed_grads) = results["none"], results["full_uniform"]
    assert recomputed_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(recomputed_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_micro_batches_are_padded_to_a_multiple_of_the_sequence_split():
    batch = {"input_ids": torch.tensor([[0, 5, 6, 7, 8]]), "attention_mask": torch.tensor([[0, 1, 1, 1, 1]]),
             "position_ids": torch.tensor([[0, 0, 1, 2, 3]]), "responses": torch.tensor([[7, 8]]),
             "response_mask": torch.ones(1, 2), "routed_experts": torch.ones(1, 5, 1, 2, dtype=torch.int16)}
    # Trimmed to its 4 used columns: a multiple of 2 already, padded to 6 for 3.
    assert micro_batches(batch, 1, columns_multiple_of=2)[0]["input_ids"].tolist() == [[5, 6, 7, 8]]
    padded = pad_columns_to_multiple(batch, 3)
    assert padded["input_ids"].tolist() == [[0, 0, 5, 6, 7, 8]]
    assert padded["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1]]
    assert (padded["routed_experts"][0, :1] == NOT_RECORDED).all() and (padded["routed_experts"][0, 1:] == 1).all()
    assert torch.equal(padded["responses"], batch["responses"])


@pytest.fixture(scope="module")
def sequence_parallel_runs(tmp_path_factory):
    """The worker's results: a dense actor and critic, and a replayed MoE actor, at TP 2 with and without
    sequence parallelism."""
    from tests.workers.sequence_parallel_worker import run_cases_on_two_ranks

    return run_cases_on_two_ranks(tmp_path_factory.mktemp("sequence_parallel"), "sequence_parallel_worker",
                                  num_layers=2, tp=2, pp=1)


def load_pair(runs: Path, case: str, rank: int) -> tuple[dict, dict]:
    return tuple(torch.load(runs / f"{case}_sp{sp}_rank{rank}.pt") for sp in (0, 1))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen2_actor", "qwen2_critic"])
def test_sequence_parallel_gives_the_losses_and_gradients_without_it(sequence_parallel_runs, case):
    for rank in (0, 1):
        plain, split = load_pair(sequence_parallel_runs, case, rank)
        torch.testing.assert_close(split["outputs"], plain["outputs"], rtol=1e-5, atol=1e-6)
        assert split["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
        assert split["grads"].keys() == plain["grads"].keys()
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(split["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=f"rank {rank}: {name}")


@pytest.mark.slow
def test_sequence_parallel_replays_each_rank_s_part_of_the_routes(sequence_parallel_runs):
    """Random routes, replayed: a TP rank taking routes of other tokens would give other log-probs. megatron
    trains an MoE layer at TP 2 only with sequence parallelism: its loss is checked against the log-probs of
    the forward without it."""
    from tests.workers.roles_worker import fixed_batch

    mask = fixed_batch(300, 0)["response_mask"]
    for rank in (0, 1):
        plain, split = load_pair(sequence_parallel_runs, "mixtral_replay_actor", rank)
        torch.testing.assert_close(split["outputs"], plain["outputs"], rtol=1e-5, atol=1e-6)
        assert split["loss"] == pytest.approx(((plain["outputs"] * mask).sum() / mask.sum()).item(), rel=1e-5)
        assert split["grads"] and all(grad.isfinite().all() for grad in split["grads"].values())


@pytest.mark.parametrize("overrides, problem", [
    (["actor.recompute.granularity=full", "actor.recompute.num_layers=3"],
     "actor.recompute.num_layers=3 must divide the 4 layers of each pipeline stage"),
    (["critic.recompute.granularity=full", "critic.recompute.method=block", "critic.recompute.num_layers=5"],
     "critic.recompute.num_layers=5 exceeds the 4 layers of each pipeline stage"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true splits the sequence over the TP ranks"),
    (["actor.recompute.granularity=some"], "actor.recompute.granularity 'some' is unknown"),
    (["actor.optim.cpu_offload=true", "actor.optim.use_distributed_optimizer=true"],
     "actor.optim.cpu_offload=true runs megatron's HybridDeviceOptimizer, which needs CUDA"),
    (["parallel.vpp=2"], "parallel.vpp=2 interleaves model chunks over the pipeline ranks and parallel.pp=1 has one"),
])
def test_preflight_refuses_memory_settings_it_cannot_run(tiny_models, prompt_file, overrides, problem):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]",
                                "data.batch_size=4", "actor.mini_batch_size=4", "critic.mini_batch_size=4",
                                *overrides])
    with pytest.raises(ConfigError) as refused:
        preflight_check(config, world_size=1)
    lines = str(refused.value).splitlines()[1:]
    assert len(lines) == 1 and problem in lines[0], lines


@pytest.mark.slow
def test_a_short_run_logs_peak_memory_with_full_recompute(tmp_path):
    """An SFT job (full recompute wired from the config) with trainer.memory_metrics on CPU: verl's perf/ names,
    every step; more than the model's weights alone."""
    import json
    import subprocess
    import sys

    from verl_mega.data.synthetic import make_task_rows, sft_conversations
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES
    from verl_mega.models.tiny import make_tiny_hf_model

    hf_dir = make_tiny_hf_model(tmp_path / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    rows = write_rows(sft_conversations(make_task_rows("copy", 32, seed=0, max_digits=2)), tmp_path / "sft.jsonl")
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "verl_mega.cli", "sft", "--config", str(EXAMPLES / "sft_demo.yaml"),
               f"model.hf_path={hf_dir}", f"data.train_files=[{rows}]", f"trainer.run_dir={run_dir}",
               "trainer.total_steps=2", "trainer.memory_metrics=true", "actor.recompute.granularity=full"]
    from verl_mega.parallel.world import TORCHRUN_VARIABLES

    # Not the one-rank world this module's other tests export while it lives: the job starts its own.
    env = {name: value for name, value in os.environ.items() if name not in TORCHRUN_VARIABLES}
    done = subprocess.run(command, capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    weights = sum(path.stat().st_size for path in hf_dir.glob("*.safetensors")) / 1024**3
    for record in records:
        assert record["perf/max_memory_allocated_gb"] > weights
        assert record["perf/max_memory_reserved_gb"] >= record["perf/max_memory_allocated_gb"]
