"""LoRA cases of the layout grids' launches (tests/workers/layout_grid_worker.py runs them; tests/test_lora.py compares):

- `layers`: at TP 2, a column- and a row-parallel linear with adapters, forward and backward on known full
  weights, without and with dropout; each rank saves its shards (and the RNG states its masks came from), the test
  puts them together against y = W x + (alpha/r) B A (m x), m the TP 1 mask the ranks' masks make.
- `update` of a model at (TP, PP, EP), in fp32 or bf16: a LoRA actor's PPO update (two optimizer steps, KL to its adapters-off
  reference) and a LoRA critic's value updates on the role grid's batch; saves the metrics, the effective weights
  W + s B A as full HF tensors (every expert's), and the reference's log-probs before and after the update.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tests.workers.roles_worker import MICRO_BATCH, MINI_BATCH, fixed_batch, gather_hf_weights

HIDDEN, QKV, RANK, ALPHA = 12, 20, 4, 6.0


class TwoLinears(torch.nn.Module):
    """An attention block's two linears as megatron builds them: linear_qkv column-, linear_proj row-parallel."""

    def __init__(self, hidden: int = HIDDEN, qkv: int = QKV, dtype=torch.float32):
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        config = ModelParallelConfig(params_dtype=dtype, use_cpu_initialization=True)
        init = torch.nn.init.normal_
        self.linear_qkv = ColumnParallelLinear(hidden, qkv, config=config, init_method=init, bias=False,
                                               gather_output=False, skip_bias_add=True)
        self.linear_proj = RowParallelLinear(qkv, hidden, config=config, init_method=init, bias=False,
                                             input_is_parallel=True, skip_bias_add=True)

    def forward(self, x):
        return self.linear_proj(self.linear_qkv(x)[0])[0]


def full_tensors(seed: int = 5) -> dict[str, torch.Tensor]:
    """The whole weights, B matrices, inputs and output gradients of both layers, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    return {"qkv.weight": draw(QKV, HIDDEN), "qkv.b": draw(QKV, RANK), "qkv.x": draw(3, 2, HIDDEN),
            "qkv.grad": draw(3, 2, QKV), "proj.weight": draw(HIDDEN, QKV), "proj.b": draw(HIDDEN, RANK),
            "proj.x": draw(3, 2, QKV), "proj.grad": draw(3, 2, HIDDEN)}


DROPOUT = 0.5


def run_layers(out_dir: Path) -> None:
    """Each TP rank's outputs and gradients of both adapted layers at TP 2, into out_dir/layers_tp{rank}.pt: without
    dropout, and with DROPOUT in training mode beside the RNG states each layer's mask was drawn from (the
    generator the TP ranks share, `rng`, and the model-parallel tracker's, `tracker_rng`)."""
    from verl_mega.parallel.state import init_parallel

    layout = init_parallel(2, 1)
    saved = {}
    for prefix, dropout in (("", 0.0), ("dropout_", DROPOUT)):
        for name, module, x, grad in adapted_layers(layout.tp_rank, dropout):
            rng = rng_states()
            x = x.clone().requires_grad_()
            out, _ = module(x)
            out.backward(grad)
            saved[prefix + name] = {"out": out.detach(), "x_grad": x.grad, "a": module.lora_a.detach().clone(),
                                    "a_grad": module.lora_a.grad, "b_grad": module.lora_b.grad, **rng}
    torch.save(saved, out_dir / f"layers_tp{layout.tp_rank}.pt")
    dist.barrier()


def rng_states() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"rng": torch.get_rng_state(), "tracker_rng": get_cuda_rng_tracker().get_states()["model-parallel-rng"]}


def adapted_layers(rank: int, dropout: float) -> list[tuple]:
    """(name, layer, its input, its output's gradient) of both layers with adapters at TP rank `rank` of 2, their
    weights and B the shards of full_tensors()'."""
    from verl_mega.config import LoraConfig
    from verl_mega.models.lora import apply_lora

    full = full_tensors()
    model = TwoLinears()
    apply_lora(model, LoraConfig(rank=RANK, alpha=ALPHA, dropout=dropout))
    rows = slice(rank * QKV // 2, (rank + 1) * QKV // 2)
    qkv, proj = model.linear_qkv, model.linear_proj
    with torch.no_grad():  # column: W and B split by output rows; row: W split by input columns, B whole
        qkv.weight.copy_(full["qkv.weight"][rows])
        qkv.lora_b.copy_(full["qkv.b"][rows])
        proj.weight.copy_(full["proj.weight"][:, rows])
        proj.lora_b.copy_(full["proj.b"])
    return [("qkv", qkv, full["qkv.x"], full["qkv.grad"][..., rows]),
            ("proj", proj, full["proj.x"][..., rows], full["proj.grad"])]


def update_name(model: str, dtype: str, tp: int, pp: int, ep: int, dp: int) -> str:
    """The file stem of one update's results: fp32 ones under the model's name alone, as they came first."""
    return f"{model}{'' if dtype == 'fp32' else '_' + dtype}_tp{tp}pp{pp}ep{ep}dp{dp}"


def run_update(ckpt: Path, out_dir: Path, model: str, tp: int, pp: int, ep: int, dtype: str = "fp32") -> None:
    """One LoRA actor update and two LoRA critic updates at (tp, pp, ep) in `dtype` from `ckpt` (converted at that
    layout); the last stages' results (TP rank 0, DP rank 0) into out_dir/{update_name(...)}_stage{S}.pt, with the
    adapters' dtypes and those of the optimizer's copies of them."""
    from verl_mega.checkpoint.manifest import Manifest
    from verl_mega.config import LoraConfig, OptimConfig, PolicyLossConfig, ValueLossConfig
    from verl_mega.models import HFModelConfig, family_for
    from verl_mega.models.lora import lora_modules, lora_parameters, merged_weight
    from verl_mega.parallel.state import init_parallel
    from verl_mega.roles.actor import Actor
    from verl_mega.roles.critic import Critic
    from verl_mega.roles.reference import make_reference
    from verl_mega.run.training_state import _inner_states

    layout = init_parallel(tp, pp, ep)
    cfg = HFModelConfig.from_dict(Manifest.read(ckpt).hf_config)
    batch = fixed_batch(cfg.vocab_size, pad_id=0)
    # As roles_worker's update: large eps makes Adam's step follow the gradient's size.
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0, adam_eps=1e-2,
                        use_distributed_optimizer=layout.dp > 1)
    lora = LoraConfig(rank=RANK, alpha=ALPHA)
    actor = Actor(ckpt, optim, PolicyLossConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1),
                  schedule_steps=4, dtype=dtype, lora=lora)
    reference = make_reference(ckpt, use_kl=True, actor=actor, dtype=dtype)
    noise = torch.Generator().manual_seed(1)
    batch["ref_log_probs"] = reference.compute_ref_log_prob(batch, MICRO_BATCH)
    batch["old_log_probs"] = batch["ref_log_probs"] + 0.3 * torch.randn(batch["responses"].shape, generator=noise)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=noise)
    batch["returns"] = torch.randn(batch["responses"].shape, generator=noise)
    batch["values"] = torch.zeros(batch["responses"].shape)
    metrics = actor.update_policy(batch, ppo_epochs=1, mini_batch_size=MINI_BATCH, micro_batch_size=MICRO_BATCH)
    dtypes = {"adapters": {param.dtype for _, param in lora_parameters(actor.model)},
              "optimizer": {param.dtype for param, _ in _inner_states(actor.trainable.optimizer)}}
    reference_after = reference.compute_ref_log_prob(batch, MICRO_BATCH)
    module = actor.model.module
    with torch.no_grad():  # the effective weights, compared as HF tensors
        for info in lora_modules(module):
            layer = module.get_submodule(info.name)
            layer.weight.copy_(merged_weight(layer.weight, layer.lora_a, layer.lora_b, info.scale))
    weights = gather_hf_weights(module, cfg, family_for(cfg))
    critic = Critic(ckpt, optim, ValueLossConfig(cliprange_value=0.5), schedule_steps=4, dtype=dtype, lora=lora)
    critic_metrics = [critic.update_critic(batch, ppo_epochs=1, mini_batch_size=MINI_BATCH * 2,
                                           micro_batch_size=MICRO_BATCH) for _ in range(2)]
    if layout.tp_rank == 0 and layout.dp_rank == 0:
        torch.save({"metrics": metrics, "weights": weights, "reference": batch["ref_log_probs"],
                    "reference_after": reference_after, "critic_metrics": critic_metrics,
                    "response_mask": batch["response_mask"], "dtypes": dtypes},
                   out_dir / f"{update_name(model, dtype, tp, pp, ep, layout.dp)}_stage{layout.pp_rank}.pt")
    dist.barrier()


# The LoRA offline jobs (`jobs`): SFT at TP 2, DPO at DP 2 (the distributed optimizer), on the role grid's model.
JOB_LAYOUTS = {"sft": (2, 1), "dpo": (1, 1)}  # job -> (TP, PP); DP is what the world's 2 ranks leave
JOB_STEPS = 6


def job_config(job: str, hf_dir: Path, ckpt: Path, data: Path, run_dir: Path):
    from verl_mega.config import load_config
    from verl_mega.demo import EXAMPLES

    tp, pp = JOB_LAYOUTS[job]
    example = {"sft": "sft_demo.yaml", "dpo": "dpo_demo.yaml"}[job]
    return load_config(EXAMPLES / example, [
        f"model.hf_path={hf_dir}", f"model.actor_ckpt={ckpt}", f"data.train_files=[{data}]",
        f"trainer.run_dir={run_dir}", f"parallel.tp={tp}", f"parallel.pp={pp}", "actor.lora.rank=4",
        "actor.optim.lr=1e-2", f"actor.optim.use_distributed_optimizer={str(tp * pp < 2).lower()}",
        f"trainer.total_steps={JOB_STEPS}", "trainer.val_every=0", "trainer.tensorboard=false"])


def job_data(out_dir: Path) -> dict[str, Path]:
    """The copy task's SFT conversations and preference pairs, written by rank 0: one batch of each (the demo
    configs' data.batch_size), so that every step trains on the same rows and the loss must fall."""
    from verl_mega.data.synthetic import make_task_rows, preference_pairs, sft_conversations
    from verl_mega.data.tables import write_rows

    files = {"sft": out_dir / "sft.jsonl", "dpo": out_dir / "pairs.jsonl"}
    if dist.get_rank() == 0:
        rows = make_task_rows("copy", 32, seed=0, max_digits=2)
        write_rows(sft_conversations(rows), files["sft"])
        write_rows(preference_pairs(rows)[:16], files["dpo"])
    dist.barrier()
    return files


def run_jobs(roles: Path, out_dir: Path) -> None:
    """`verl-mega sft` and `verl-mega preference` (DPO) with LoRA on two ranks, each job built as the trainer builds
    it, into out_dir/{job}/ (run folders); out_dir/{job}_rank{R}.pt records, on each rank, whether the frozen base
    stayed bitwise as loaded, which adapters moved, what trained, and (DPO) whether the reference is the actor's
    own model with its adapters off."""
    from verl_mega.models.lora import lora_parameters
    from verl_mega.parallel.state import init_parallel
    from verl_mega.roles.reference import AdaptersOffReference
    from verl_mega.trainer.main import OFFLINE_JOBS, model_checksums

    init_parallel(1, 1)
    data = job_data(out_dir)
    for job, (tp, pp) in JOB_LAYOUTS.items():
        config = job_config(job, roles / "hf", roles / "ckpt" / f"tp{tp}pp{pp}", data[job], out_dir / job)
        layout = init_parallel(tp, pp, seed=config.trainer.seed)
        (out_dir / job).mkdir(exist_ok=True)  # the trainer's claim on the run folder makes it
        trainer = OFFLINE_JOBS[config.job](config, layout, base_checksums=model_checksums(config),
                                           actor_ckpt=Path(config.model.actor_ckpt))
        model = trainer.actor.model
        base = {name: param.detach().clone() for name, param in model.named_parameters() if not param.requires_grad}
        adapters = {name: param.detach().clone() for name, param in lora_parameters(model)}
        trainer.fit()
        trainer.close()
        record = {
            "base_changed": [name for name, param in model.named_parameters()
                             if name in base and not torch.equal(param, base[name])],
            "base_count": len(base),
            "adapters_moved": sorted(name for name, param in lora_parameters(model)
                                     if not torch.equal(param, adapters[name])),
            "adapters": sorted(adapters),
            "trained": sorted(name.removeprefix("module.") for name, param in model.named_parameters()
                              if param.requires_grad),
        }
        reference = getattr(trainer, "reference", None)
        if reference is not None:
            storage = {param.data_ptr() for param in model.parameters()}
            record["reference_is_adapters_off"] = isinstance(reference, AdaptersOffReference)
            record["reference_storage_is_the_actors"] = {p.data_ptr() for p in reference.model.parameters()} <= storage
        torch.save(record, out_dir / f"{job}_rank{layout.rank}.pt")
        dist.barrier()
