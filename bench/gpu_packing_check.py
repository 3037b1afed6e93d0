"""THD-packed forwards against padded ones with transformer-engine's layers, for `bench/gpu_check.sh`:

    python -m torch.distributed.run --nproc-per-node 1 bench/gpu_packing_check.py WORK

The actor (WORK/ckpt_tp1, bf16, transformer-engine's layer spec) scores the same rollout batch with its rows
packed into one THD row and padded; the log-probs must agree within bf16 rounding, and one update step from
the packed forward must give a finite loss and gradient norm.
"""
import random
import sys

import torch

from verl_mega.config import OptimConfig
from verl_mega.parallel.state import destroy_parallel, init_parallel
from verl_mega.roles.actor import Actor
from verl_mega.trainer.rollout_batch import build_rollout_batch

ROWS, RESPONSE_LENGTH = 8, 24
TOLERANCE = 0.05  # bf16 log-probs of a tiny model: the kernels sum in different orders


def main(work: str) -> None:
    init_parallel(tp=1)
    actor = Actor(f"{work}/ckpt_tp1", OptimConfig(lr=1e-5), schedule_steps=1, packed_sequences="true",
                  dtype="bf16")
    assert actor.trainable.packed, "use_packed_sequences=true did not pack with transformer-engine's layers"
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randint(2, 12))] for _ in range(ROWS)]
    responses = [[rng.randrange(3, 60) for _ in range(rng.randint(1, RESPONSE_LENGTH))] for _ in range(ROWS)]
    batch = build_rollout_batch(prompts, responses, RESPONSE_LENGTH, pad_token_id=0)

    packed = actor.compute_log_prob(batch, micro_batch_size=4)["log_probs"]
    actor.trainable.packed = False
    padded = actor.compute_log_prob(batch, micro_batch_size=4)["log_probs"]
    actor.trainable.packed = True
    mask = batch["response_mask"].bool().to(packed.device)
    gap = (packed - padded).abs()[mask].max().item()
    print(f"packed vs padded log-probs: max |diff| {gap:.4f} over {int(mask.sum())} tokens")
    assert gap < TOLERANCE, f"packed log-probs differ from padded ones by {gap}"

    batch["advantages"] = torch.randn(batch["responses"].shape) * batch["response_mask"]
    metrics = actor.update_policy(batch, ppo_epochs=1, mini_batch_size=ROWS, micro_batch_size=4)
    print(f"packed update: pg_loss {metrics['pg_loss']:.4f}, grad_norm {metrics['grad_norm']:.4f}")
    assert all(torch.isfinite(torch.tensor(value)) for value in metrics.values()), metrics
    destroy_parallel()
    print("packing check passed")


if __name__ == "__main__":
    main(sys.argv[1])
