"""torchrun worker for tests/test_training_state.py: train the actor and critic, save and resume their state.

    training_state_worker save   CKPT_ROOT OUT_DIR TP,PP
        for each optimizer kind (and "lora": LoRA adapters on both roles, the distributed optimizer): update A,
        save the state into OUT_DIR/state/KIND/ROLE, update B; record B
    training_state_worker resume CKPT_ROOT OUT_DIR TP,PP [TP,PP ...]
        at each layout, for each optimizer kind: fresh roles from the initial checkpoint, load the saved
        state, update B; record it (and, at the first layout, the error of loading the actor's state into the critic)

Records go to OUT_DIR/{uninterrupted|resumed_tpTppP}_{KIND}_stage{PP_RANK}.pt, written by TP and DP rank 0.
CKPT_ROOT/tp{TP}pp{PP} are the initial checkpoint converted at each layout.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from verl_mega.parallel.process_exit import exit_process

from tests.workers.roles_worker import MINI_BATCH, fixed_batch, gather_hf_weights

OPTIMIZER_KINDS = {"plain": False, "distributed": True, "lora": True}
LORA_RANK = 4
MICRO_BATCH = 1  # one row per DP rank at DP=4 (TP*PP=2 on 8 processes)


def training_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    batch = fixed_batch(vocab_size, pad_id=0)
    noise = torch.Generator().manual_seed(1)
    shape = batch["responses"].shape
    batch["old_log_probs"] = -torch.log(torch.tensor(float(vocab_size))) + 0.3 * torch.randn(shape, generator=noise)
    batch["advantages"] = torch.randn(shape, generator=noise)
    batch["returns"] = torch.randn(shape, generator=noise)
    batch["values"] = torch.zeros(shape)
    return batch


def build_roles(ckpt: Path, use_distributed_optimizer: bool, lora_rank: int = 0):
    from verl_mega.config import LoraConfig, OptimConfig, PolicyLossConfig
    from verl_mega.roles.actor import Actor
    from verl_mega.roles.critic import Critic

    # A warmup and a cosine decay make the LR schedule's state matter; large eps makes the update follow
    # the gradient's size, so a wrong Adam state shows in the weights.
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0, adam_eps=1e-2, lr_warmup_steps=1,
                        lr_decay_style="cosine",
                        use_distributed_optimizer=use_distributed_optimizer)
    # Scale 16: update A moves the LoRA policy far enough that ppo_kl (a mean of log-prob differences, -0.011) is
    # not mostly cancellation; at scale 4 (-0.005) its rounding at another layout came to 1.5e-5 of it, past REL_TOL.
    lora = LoraConfig(rank=lora_rank, alpha=64.0)
    return (Actor(ckpt, optim, PolicyLossConfig(entropy_coeff=0.01), schedule_steps=6, lora=lora),
            Critic(ckpt, optim, schedule_steps=6, lora=lora))


def roles_of_kind(ckpt: Path, kind: str):
    return build_roles(ckpt, OPTIMIZER_KINDS[kind], LORA_RANK if kind == "lora" else 0)


def gather_adapters(module, cfg, family) -> dict[str, torch.Tensor]:
    """This PP stage's adapters as whole tensors named by HF module (`lora_B:model.layers.0.self_attn.q_proj.weight`):
    split shards gathered over TP, B's rows through the family spec like the weight's (gate|up halves apart), so
    the names and values are the same at every layout."""
    from megatron.core import parallel_state as ps

    from verl_mega.models.lora import lora_modules
    from verl_mega.models.sharding import rank_slots, split_mcore_to_hf
    from verl_mega.parallel.state import current_layout

    layout = current_layout()
    adapted = {info.name: info.kind for info in lora_modules(module)}
    group = ps.get_tensor_model_parallel_group()
    found = {}
    for slot in rank_slots(cfg, family, layout.pp_rank, layout.pp):
        name = slot.local_name.removesuffix(".weight")
        if name not in adapted:
            continue
        linear = module.get_submodule(name)
        split, whole = (linear.lora_b, linear.lora_a) if adapted[name] == "column" else (linear.lora_a, linear.lora_b)
        shards = [torch.empty_like(split) for _ in range(layout.tp)]
        dist.all_gather(shards, split.detach().contiguous(), group=group)
        if adapted[name] == "column":
            for hf_name, rows in split_mcore_to_hf(slot, cfg, shards):
                found[f"lora_B:{hf_name}"], found[f"lora_A:{hf_name}"] = rows.clone(), whole.detach().clone()
        else:
            found[f"lora_A:{slot.hf_names[0]}"] = torch.cat(shards, dim=1)
            found[f"lora_B:{slot.hf_names[0]}"] = whole.detach().clone()
    return found


def update(actor, critic, batch) -> dict:
    return {
        "actor_metrics": actor.update_policy(batch, ppo_epochs=1, mini_batch_size=MINI_BATCH,
                                             micro_batch_size=MICRO_BATCH),
        "critic_metrics": critic.update_critic(batch, ppo_epochs=1, mini_batch_size=MINI_BATCH,
                                               micro_batch_size=MICRO_BATCH),
    }


def record(actor, critic, metrics: dict, cfg, family, out: Path) -> None:
    """Save the metrics and every weight of both roles, merged over TP, from this PP stage."""
    from verl_mega.parallel.state import current_layout

    layout = current_layout()
    result = {**metrics, "actor_weights": gather_hf_weights(actor.model.module, cfg, family),
              "critic_weights": gather_hf_weights(critic.model.module, cfg, family)}
    for role, model in (("actor_weights", actor.model.module), ("critic_weights", critic.model.module)):
        adapters = gather_adapters(model, cfg, family)
        if result[role] is not None:
            result[role].update(adapters)
    if layout.is_last_stage:
        value_head = critic.model.module.output_layer
        result["critic_weights"] = {**(result["critic_weights"] or {}), "value_head.weight": value_head.weight.detach().clone(),
                                    "value_head.bias": value_head.bias.detach().clone()}
    if layout.tp_rank == 0 and layout.dp_rank == 0:
        torch.save(result, out.with_name(f"{out.name}_stage{layout.pp_rank}.pt"))
    dist.barrier()


def model_info(ckpt: Path):
    from verl_mega.checkpoint.manifest import Manifest
    from verl_mega.models import HFModelConfig, family_for

    cfg = HFModelConfig.from_dict(Manifest.read(ckpt).hf_config)
    return cfg, family_for(cfg)


def state_dir(out_dir: Path, kind: str, role: str) -> Path:
    return out_dir / "state" / kind / role


def start_phase(ckpt_root: Path, tp: int, pp: int):
    """Parallel groups at (tp, pp), the checkpoint converted for that layout, its model and the fixed batch."""
    from verl_mega.parallel.state import init_parallel

    init_parallel(tp, pp)
    ckpt = ckpt_root / f"tp{tp}pp{pp}"
    cfg, family = model_info(ckpt)
    return ckpt, cfg, family, training_batch(cfg.vocab_size)


def save_phase(ckpt_root: Path, out_dir: Path, tp: int, pp: int) -> None:
    from verl_mega.run.training_state import save_training_state

    ckpt, cfg, family, batch = start_phase(ckpt_root, tp, pp)
    for kind in OPTIMIZER_KINDS:
        actor, critic = roles_of_kind(ckpt, kind)
        update(actor, critic, batch)
        for role, trainable in (("actor", actor.trainable), ("critic", critic.trainable)):
            directory = state_dir(out_dir, kind, role)
            if dist.get_rank() == 0:
                directory.mkdir(parents=True)
            save_training_state(trainable, directory)
        record(actor, critic, update(actor, critic, batch), cfg, family, out_dir / f"uninterrupted_{kind}")


def resume_phase(ckpt_root: Path, out_dir: Path, layouts: list[tuple[int, int]]) -> None:
    from verl_mega.run.training_state import load_training_state

    for index, (tp, pp) in enumerate(layouts):
        ckpt, cfg, family, batch = start_phase(ckpt_root, tp, pp)
        for kind in OPTIMIZER_KINDS:
            actor, critic = roles_of_kind(ckpt, kind)
            if index == 0 and kind in ("distributed", "lora"):
                # The distributed full-parameter actor loads the LoRA state, the LoRA actor the full-parameter one.
                other = state_dir(out_dir, "lora" if kind == "distributed" else "distributed", "actor")
                save_refusal(lambda: load_training_state(actor.trainable, other), out_dir / f"{kind}_kind_refusal.pt")
            if index == 0 and kind == "plain":
                save_refusal(lambda: load_training_state(critic.trainable, state_dir(out_dir, kind, "actor")),
                             out_dir / "wrong_model_refusal.pt")
            load_training_state(actor.trainable, state_dir(out_dir, kind, "actor"))
            load_training_state(critic.trainable, state_dir(out_dir, kind, "critic"))
            assert_fused_adam(actor.trainable.optimizer)
            record(actor, critic, update(actor, critic, batch), cfg, family, out_dir / f"resumed_tp{tp}pp{pp}_{kind}")


def save_refusal(load, out: Path) -> None:
    """Record the one-line error `load()` raises (None if it loads)."""
    try:
        load()
        refusal = None
    except ValueError as error:
        refusal = str(error)
    if dist.get_rank() == 0:
        torch.save(refusal, out)


def assert_fused_adam(optimizer) -> None:
    """Megatron's torch AdamW runs torch's fused kernel, also after a load restored the saved groups."""
    for sub_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in sub_optimizer.optimizer.param_groups:
            assert group["fused"], "torch's AdamW is not fused"
            for param in group["params"]:
                assert sub_optimizer.optimizer.state[param]["step"].device == param.device


def main(argv: list[str]) -> None:
    from verl_mega.parallel.state import destroy_parallel

    phase, ckpt_root, out_dir, *layouts = argv
    layouts = [tuple(int(size) for size in layout.split(",")) for layout in layouts]
    if phase == "save":
        save_phase(Path(ckpt_root), Path(out_dir), *layouts[0])
    else:
        resume_phase(Path(ckpt_root), Path(out_dir), layouts)
    destroy_parallel()


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
