"""torchrun worker for tests/test_mixed_precision.py: the actor in bf16 and fp16 at DP=2, with the plain and the
distributed optimizer: update A, save its training state, update B; then a fresh actor loads the state and runs
update B again.

    mixed_precision_worker CKPT OUT_DIR

Records OUT_DIR/{DTYPE}_{KIND}.pt on rank 0: the model parameters' dtypes, the optimizer's fp32 main weights
after A as saved and as loaded, the loss scale, and update B's metrics and weights in both runs.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from verl_mega.parallel.process_exit import exit_process

from tests.workers.training_state_worker import MICRO_BATCH, MINI_BATCH, OPTIMIZER_KINDS, training_batch

DTYPES = ("bf16", "fp16")


def build_actor(ckpt: Path, dtype: str, distributed: bool):
    from verl_mega.config import OptimConfig, PolicyLossConfig
    from verl_mega.roles.actor import Actor

    optim = OptimConfig(lr=1e-2, weight_decay=0.01, adam_eps=1e-2, lr_warmup_steps=1, lr_decay_style="cosine",
                        use_distributed_optimizer=distributed)
    return Actor(ckpt, optim, PolicyLossConfig(entropy_coeff=0.01), schedule_steps=4, dtype=dtype)


def update(actor, batch) -> dict:
    return actor.update_policy(batch, ppo_epochs=1, mini_batch_size=MINI_BATCH, micro_batch_size=MICRO_BATCH)


def main_weights(actor) -> list[torch.Tensor]:
    """The fp32 copies megatron's optimizer steps on (this DP rank's ranges for the distributed one)."""
    from verl_mega.run.training_state import _inner_states

    return [param.detach().clone() for param, _ in _inner_states(actor.trainable.optimizer)]


def weights(actor) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in actor.model.module.named_parameters()}


def main(argv: list[str]) -> None:
    from verl_mega.run.training_state import load_training_state, save_training_state
    from verl_mega.parallel.state import destroy_parallel, init_parallel

    ckpt, out = Path(argv[0]), Path(argv[1])
    init_parallel(1, 1)
    for dtype in DTYPES:
        for kind, distributed in OPTIMIZER_KINDS.items():
            actor = build_actor(ckpt, dtype, distributed)
            batch = training_batch(actor.vocab_size)
            update(actor, batch)
            state = out / "state" / f"{dtype}_{kind}"
            if dist.get_rank() == 0:
                state.mkdir(parents=True)
            save_training_state(actor.trainable, state)
            saved_main = main_weights(actor)
            loss_scale = actor.trainable.optimizer.get_loss_scale().item()
            straight = {"metrics": update(actor, batch), "weights": weights(actor)}

            resumed_actor = build_actor(ckpt, dtype, distributed)
            load_training_state(resumed_actor.trainable, state)
            result = {
                "param_dtypes": {name: param.dtype for name, param in resumed_actor.model.module.named_parameters()},
                "saved_main": saved_main, "loaded_main": main_weights(resumed_actor),
                "loss_scale": (loss_scale, resumed_actor.trainable.optimizer.get_loss_scale().item()),
                "straight": straight,
                "resumed": {"metrics": update(resumed_actor, batch), "weights": weights(resumed_actor)},
            }
            if dist.get_rank() == 0:
                torch.save(result, out / f"{dtype}_{kind}.pt")
            dist.barrier()
    destroy_parallel()


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
