"""torchrun worker for tests/test_export_critic.py: for each converted checkpoint given, build the critic, take
one value-loss step (so the value head is non-zero), score the fixed batch and save the critic's weights.

`critic_export_worker TP PP OUT_DIR CKPT [CKPT ...]` writes OUT_DIR/<ckpt name>/critic (the checkpoint) and
OUT_DIR/<ckpt name>/values.pt (`compute_values` on `roles_worker.fixed_batch`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from verl_mega.parallel.process_exit import exit_process

from tests.workers.roles_worker import MICRO_BATCH, fixed_batch


def train_and_save_critic(ckpt: Path, out: Path) -> None:
    from verl_mega.checkpoint.manifest import Manifest
    from verl_mega.parallel.state import current_layout
    from verl_mega.roles.critic import Critic
    from verl_mega.run.role_weights import save_role_weights
    from verl_mega.config import OptimConfig

    layout = current_layout()
    batch = fixed_batch(Manifest.read(ckpt).hf_config["vocab_size"], pad_id=0)
    batch["values"] = torch.zeros(batch["responses"].shape)
    batch["returns"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    critic = Critic(ckpt, OptimConfig(lr=1e-2), schedule_steps=1)
    critic.update_critic(batch, ppo_epochs=1, mini_batch_size=batch["input_ids"].shape[0],
                         micro_batch_size=MICRO_BATCH)
    values = critic.compute_values(batch, MICRO_BATCH)
    save_role_weights(critic.model, ckpt, out / "critic", layout, iteration=1, role="critic")
    if layout.rank == 0:
        torch.save({"batch": batch, "values": values}, out / "values.pt")
    dist.barrier()


def main(argv: list[str]) -> None:
    from verl_mega.parallel.state import destroy_parallel, init_parallel

    tp, pp, out_dir, *ckpts = argv
    init_parallel(int(tp), int(pp))
    for ckpt in map(Path, ckpts):
        train_and_save_critic(ckpt, Path(out_dir) / ckpt.name)
    destroy_parallel()


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
