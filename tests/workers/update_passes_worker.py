"""torchrun worker for tests/test_update_passes.py: updates of the actor that must agree whichever passes and
micro-batches compute them. `update_passes_worker CKPT_ROOT HF_DIR OUT_DIR`, with CKPT_ROOT/tp1pp1 and tp2pp1
converted from HF_DIR.

- tp2: one epoch over one mini-batch, once with old log-probs from a separate forward and once taking them
  from the update's own first forward (`skip_old_pass`); then from the first forward again with planted
  rollout log-probs in the batch, the rollout correction off and on (token-level TIS); then bypass mode over
  two epochs against vanilla PPO given the rollout's log-probs as its old ones; saves every result, with the
  first forward's log-probs the update leaves behind.
- tp2: the actor's and the reference's log-probs at temperature 0.7 beside HF's on logits / 0.7
  (`temperature`).
- dp2: log-probs and two PPO steps with micro-batches of MICRO_BATCH rows, and again grouped by a token
  budget (`token_budget`), which gives the two DP ranks different numbers of micro-batches; both again with
  the rollout correction on (truncated weights and token rejection against planted rollout log-probs).
- tp2: one PPO step over several micro-batches with each weight gradient added into DDP's buffer inside its
  GEMM (the CPU default, `fused_weight_gradients`) and again as megatron's unfused path computes it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from verl_mega.parallel.process_exit import exit_process

from tests.workers.roles_worker import BATCH, MICRO_BATCH, MINI_BATCH, fixed_batch, gather_hf_weights

OPTIM = dict(lr=1e-2, weight_decay=0.01, clip_grad=1.0, adam_eps=1e-2)
# Between one and two full-width rows (11 tokens): over the whole batch, 3 micro-batches on DP rank 0 and 4 on
# rank 1, of 1 or 2 rows once trimmed.
MAX_TOKENS = 16


def load(ckpt: Path):
    from verl_mega.checkpoint.manifest import Manifest
    from verl_mega.models import HFModelConfig, family_for

    cfg = HFModelConfig.from_dict(Manifest.read(ckpt).hf_config)
    return cfg, family_for(cfg)


def training_batch(ckpt: Path, cfg) -> dict[str, torch.Tensor]:
    """The fixed batch with random advantages and the reference's log-probs (for the KL loss)."""
    from verl_mega.roles.reference import make_reference

    batch = fixed_batch(cfg.vocab_size, pad_id=0)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    batch["ref_log_probs"] = make_reference(ckpt, use_kl=True).compute_ref_log_prob(batch, MICRO_BATCH)
    return batch


def fresh_actor(ckpt: Path, use_distributed_optimizer: bool, policy_loss: str = "vanilla", **options):
    from verl_mega.config import OptimConfig, PolicyLossConfig
    from verl_mega.roles.actor import Actor

    return Actor(ckpt, OptimConfig(**OPTIM, use_distributed_optimizer=use_distributed_optimizer),
                 PolicyLossConfig(policy_loss=policy_loss, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1),
                 schedule_steps=4, **options)


def skip_old_pass(ckpt_root: Path, out_dir: Path) -> None:
    from verl_mega.config import RolloutCorrectionConfig
    from verl_mega.parallel.state import current_layout, init_parallel

    layout = init_parallel(2, 1)
    ckpt = ckpt_root / "tp2pp1"
    cfg, family = load(ckpt)
    batch = training_batch(ckpt, cfg)
    result = {}
    tis = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.2)
    for name, separate_pass, planted, correction in (
            ("separate_pass", True, False, None), ("first_forward", False, False, None),
            ("rollout_log_probs", False, True, None), ("token_tis", False, True, tis)):
        actor = fresh_actor(ckpt, use_distributed_optimizer=False, correction=correction)
        update_batch = dict(batch)
        old_log_probs = actor.compute_log_prob(batch, MICRO_BATCH)["log_probs"]
        if separate_pass:
            update_batch["old_log_probs"] = old_log_probs
        if planted:  # an engine's log-probs off by ~0.3 nats per token
            noise = torch.randn(old_log_probs.shape, generator=torch.Generator().manual_seed(4))
            update_batch["rollout_log_probs"] = (old_log_probs + 0.3 * noise) * batch["response_mask"]
        metrics = actor.update_policy(update_batch, ppo_epochs=1, mini_batch_size=BATCH,
                                      micro_batch_size=MICRO_BATCH)
        result[name] = {"metrics": metrics, "weights": gather_hf_weights(actor.model.module, cfg, family),
                        "old_log_probs": old_log_probs, "first_forward_log_probs": actor.first_forward_log_probs}
    # verl's bypass mode over two epochs of two mini-batches (off-policy, so no first forward stands in for the
    # old log-probs): the rollout's log-probs are the old ones, no pass runs, and the update is vanilla PPO's
    # given them as its old log-probs.
    rollout_log_probs = result["rollout_log_probs"]["old_log_probs"] + 0.3 * torch.randn(
        batch["responses"].shape, generator=torch.Generator().manual_seed(5))
    for name, policy_loss, old_key in (("bypass_mode", "bypass_mode", None),
                                       ("vanilla_on_rollout", "vanilla", "old_log_probs")):
        actor = fresh_actor(ckpt, use_distributed_optimizer=False, policy_loss=policy_loss)
        update_batch = {**batch, "rollout_log_probs": rollout_log_probs * batch["response_mask"]}
        if old_key:
            update_batch[old_key] = update_batch["rollout_log_probs"]
        metrics = actor.update_policy(update_batch, ppo_epochs=2, mini_batch_size=MINI_BATCH,
                                      micro_batch_size=MICRO_BATCH)
        result[name] = {"metrics": metrics, "weights": gather_hf_weights(actor.model.module, cfg, family),
                        "first_forward_log_probs": actor.first_forward_log_probs}
    result["response_mask"] = batch["response_mask"]
    if current_layout().rank == 0:
        torch.save(result, out_dir / "skip_old_pass.pt")
    dist.barrier()


def temperature(ckpt_root: Path, hf_dir: Path, out_dir: Path) -> None:
    from tests.workers.roles_worker import hf_response_logprobs

    from verl_mega.parallel.state import current_layout, init_parallel
    from verl_mega.roles.reference import make_reference

    init_parallel(2, 1)
    ckpt = ckpt_root / "tp2pp1"
    cfg, _ = load(ckpt)
    batch = fixed_batch(cfg.vocab_size, pad_id=0)
    result = {"hf": hf_response_logprobs(hf_dir, batch, temperature=0.7), "response_mask": batch["response_mask"],
              "actor": fresh_actor(ckpt, False, temperature=0.7).compute_log_prob(batch, MICRO_BATCH)["log_probs"],
              "reference": make_reference(ckpt, use_kl=True, temperature=0.7).compute_ref_log_prob(batch, MICRO_BATCH)}
    if current_layout().rank == 0:
        torch.save(result, out_dir / "temperature.pt")
    dist.barrier()


def token_budget(ckpt_root: Path, out_dir: Path) -> None:
    from verl_mega.config import RolloutCorrectionConfig
    from verl_mega.parallel.state import current_layout, init_parallel
    from verl_mega.roles.batching import dp_slice, micro_batches

    layout = init_parallel(1, 1)
    ckpt = ckpt_root / "tp1pp1"
    cfg, family = load(ckpt)
    batch = training_batch(ckpt, cfg)
    noise = torch.Generator().manual_seed(2)
    batch["old_log_probs"] = -torch.rand(batch["responses"].shape, generator=noise)
    batch["rollout_log_probs"] = batch["old_log_probs"] + 0.3 * torch.randn(batch["responses"].shape, generator=noise)
    # Both corrections acting: some weights truncated, some tokens rejected.
    corrected = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.1, rollout_rs="token_k1",
                                        rollout_rs_threshold="0.8_1.25")
    result = {}
    for name, max_tokens, correction in (("fixed", 0, None), ("budget", MAX_TOKENS, None),
                                         ("corrected_fixed", 0, corrected),
                                         ("corrected_budget", MAX_TOKENS, corrected)):
        actor = fresh_actor(ckpt, use_distributed_optimizer=True, correction=correction)
        log_probs = actor.compute_log_prob(batch, MICRO_BATCH, max_tokens=max_tokens)["log_probs"]
        metrics = actor.update_policy(batch, ppo_epochs=1, mini_batch_size=MINI_BATCH, micro_batch_size=MICRO_BATCH,
                                      max_tokens=max_tokens)
        local = dp_slice(batch, layout.dp_rank, layout.dp)
        counts = torch.tensor([len(micro_batches(local, MICRO_BATCH, max_tokens))])
        all_counts = [torch.zeros_like(counts) for _ in range(layout.dp)]
        dist.all_gather(all_counts, counts)
        result[name] = {"metrics": metrics, "log_probs": log_probs, "micro_batches": torch.cat(all_counts).tolist(),
                        "weights": gather_hf_weights(actor.model.module, cfg, family)}
    result["response_mask"] = batch["response_mask"]
    if current_layout().rank == 0:
        torch.save(result, out_dir / "token_budget.pt")
    dist.barrier()


def fused_weight_gradients(ckpt_root: Path, out_dir: Path) -> None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from verl_mega.parallel.state import current_layout, init_parallel

    init_parallel(2, 1)
    ckpt = ckpt_root / "tp2pp1"
    cfg, family = load(ckpt)
    batch = training_batch(ckpt, cfg)
    batch["old_log_probs"] = -torch.rand(batch["responses"].shape, generator=torch.Generator().manual_seed(3))
    result = {}
    for name, fused in (("fused", True), ("unfused", False)):
        actor = fresh_actor(ckpt, use_distributed_optimizer=False)
        linears = [m for m in actor.model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
        result[f"{name}_flags"] = [m.gradient_accumulation_fusion for m in linears]
        for module in linears:
            module.gradient_accumulation_fusion = fused
        actor.update_policy(batch, ppo_epochs=1, mini_batch_size=BATCH, micro_batch_size=MICRO_BATCH)
        result[name] = gather_hf_weights(actor.model.module, cfg, family)
    if current_layout().rank == 0:
        torch.save(result, out_dir / "fused_weight_gradients.pt")
    dist.barrier()


def run_passes(ckpt_root: Path, hf_dir: Path, out_dir: Path) -> None:
    """Every run above, in turn (also a case of tests/workers/layout_grid_worker.py)."""
    skip_old_pass(ckpt_root, out_dir)
    temperature(ckpt_root, hf_dir, out_dir)
    token_budget(ckpt_root, out_dir)
    fused_weight_gradients(ckpt_root, out_dir)


def main(argv: list[str]) -> None:
    from verl_mega.parallel.state import destroy_parallel

    run_passes(*(Path(arg) for arg in argv))
    destroy_parallel()


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
