"""The SFT / preference layout tests' cases, run inside tests/workers/layout_grid_worker.py's torchrun launches: at each
case, one SFT update, one DPO update and one on-policy PPO update of the actor on fixed batches; saves the metrics
and the updated weights (full, HF-named).

A case is MODEL:DTYPE:TP,PP,EP (MODEL a folder name under CKPT_ROOT, converted to MODEL/tp{TP}pp{PP}ep{EP}). A
case ending in :replay runs routing replay instead (an MoE model): the log-probs of the batch without and with
a drawn routing replayed and, at TP 1, one on-policy PPO update with it replayed (its metrics hold the router
mismatch).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tests.workers.roles_worker import BATCH, MICRO_BATCH, fixed_batch, gather_hf_weights


def sft_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    """The PPO tests' batch, with some response tokens (a user turn, say) left out of the loss."""
    batch = fixed_batch(vocab_size, pad_id=0)
    not_assistant = torch.zeros_like(batch["response_mask"])
    not_assistant[::3, 1] = 1
    batch["response_mask"] = batch["response_mask"] * (1 - not_assistant)
    return batch


def case_name(model: str, dtype: str, tp: int, pp: int, ep: int, dp: int) -> str:
    return f"{model}_{dtype}_tp{tp}pp{pp}ep{ep}dp{dp}"


def run_case(ckpt_root: Path, out_dir: Path, model: str, dtype: str, tp: int, pp: int, ep: int) -> None:
    from verl_mega.checkpoint.manifest import Manifest
    from verl_mega.config import AlgorithmConfig, OptimConfig, PolicyLossConfig
    from verl_mega.models import HFModelConfig, family_for
    from verl_mega.parallel.state import init_parallel
    from verl_mega.roles.actor import Actor
    from verl_mega.roles.preference import PAIR_METRICS, pair_sequence_loss
    from verl_mega.roles.reference import Reference

    layout = init_parallel(tp, pp, ep)
    ckpt = ckpt_root / model / f"tp{tp}pp{pp}ep{ep}"
    cfg = HFModelConfig.from_dict(Manifest.read(ckpt).hf_config)
    family = family_for(cfg)
    # Large eps: Adam's first step then follows the gradient's size, so gradient errors show in the weights.
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0, adam_eps=1e-2,
                        use_distributed_optimizer=layout.dp > 1)
    result = {}

    actor = Actor(ckpt, optim, schedule_steps=1, dtype=dtype)
    result["sft_metrics"] = actor.update_sft(sft_batch(cfg.vocab_size), mini_batch_size=BATCH,
                                             micro_batch_size=MICRO_BATCH)
    result["sft_weights"] = gather_hf_weights(actor.model.module, cfg, family)

    # Rows 0, 1 are the first pair's chosen and rejected, and so on: micro-batches of 2 rows hold whole pairs.
    batch = fixed_batch(cfg.vocab_size, pad_id=0)
    reference = Reference(ckpt, dtype=dtype)
    ref_log_probs = reference.compute_ref_log_prob(batch, MICRO_BATCH).cpu()
    batch["ref_sequence_log_probs"] = (ref_log_probs * batch["response_mask"]).sum(-1)
    # A reference other than the initial policy, so the DPO logits (and the metrics) are not all zero.
    batch["ref_sequence_log_probs"] = batch["ref_sequence_log_probs"] + torch.linspace(-1.0, 1.0, BATCH)
    actor = Actor(ckpt, optim, schedule_steps=1, dtype=dtype)
    result["dpo_metrics"] = actor.update_on_sequences(batch, BATCH, MICRO_BATCH, PAIR_METRICS,
                                                      pair_sequence_loss(AlgorithmConfig(loss="dpo", beta=0.5)))
    result["dpo_weights"] = gather_hf_weights(actor.model.module, cfg, family)

    # On-policy (one epoch, one mini-batch: the old log-probs are the first forward's), as GRPO updates.
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(3))
    actor = Actor(ckpt, optim, PolicyLossConfig(), schedule_steps=1, dtype=dtype)
    result["ppo_metrics"] = actor.update_policy(batch, ppo_epochs=1, mini_batch_size=BATCH,
                                                micro_batch_size=MICRO_BATCH)
    result["ppo_weights"] = gather_hf_weights(actor.model.module, cfg, family)
    if layout.tp_rank == 0 and layout.dp_rank == 0:
        torch.save(result, out_dir / f"{case_name(model, dtype, tp, pp, ep, layout.dp)}_stage{layout.pp_rank}.pt")
    dist.barrier()


def drawn_routing(batch: dict[str, torch.Tensor], experts: int, moe_layers: int, top_k: int) -> torch.Tensor:
    """A rollout routing for every valid token of `batch` (distinct experts drawn per token and layer), the same
    on every rank; NOT_RECORDED at padding."""
    from verl_mega.roles.routing_replay import NOT_RECORDED

    generator = torch.Generator().manual_seed(1)
    rows, columns = batch["input_ids"].shape
    draws = torch.rand(rows, columns, moe_layers, experts, generator=generator).argsort(dim=-1)[..., :top_k]
    return draws.masked_fill(~batch["attention_mask"].bool()[..., None, None], NOT_RECORDED).to(torch.int16)


def run_replay_case(ckpt_root: Path, out_dir: Path, model: str, dtype: str, tp: int, pp: int, ep: int) -> None:
    from verl_mega.checkpoint.manifest import Manifest
    from verl_mega.config import OptimConfig
    from verl_mega.models import HFModelConfig
    from verl_mega.parallel.state import init_parallel
    from verl_mega.roles.actor import Actor

    layout = init_parallel(tp, pp, ep)
    ckpt = ckpt_root / model / f"tp{tp}pp{pp}ep{ep}"
    cfg = HFModelConfig.from_dict(Manifest.read(ckpt).hf_config)
    actor = Actor(ckpt, OptimConfig(lr=1e-2, adam_eps=1e-2, use_distributed_optimizer=layout.dp > 1),
                  schedule_steps=1, dtype=dtype, router_replay="rollout")
    batch = fixed_batch(cfg.vocab_size, pad_id=0)
    # Response tokens only: untrimmed micro-batches (pipeline stages of the CPU MoE path) give padding a value too.
    natural = actor.compute_log_prob(batch, MICRO_BATCH)["log_probs"].cpu() * batch["response_mask"]
    batch["routed_experts"] = drawn_routing(batch, cfg.num_experts, cfg.num_layers, cfg.moe_top_k)
    replayed = actor.compute_log_prob(batch, MICRO_BATCH)["log_probs"].cpu() * batch["response_mask"]
    result = {"natural": natural, "replayed": replayed}
    # megatron trains MoE layers at TP > 1 only with sequence parallelism, which verl_mega does not turn on.
    if tp == 1:
        batch["advantages"] = torch.linspace(-1.0, 1.0, BATCH)[:, None] * batch["response_mask"]
        result["update"] = actor.update_policy(batch, ppo_epochs=1, mini_batch_size=BATCH,
                                               micro_batch_size=MICRO_BATCH)
    if layout.rank == 0:
        torch.save(result, out_dir / f"{case_name(model, dtype, tp, pp, ep, layout.dp)}_replay.pt")
    dist.barrier()


def run_named_case(ckpt_root: Path, out_dir: Path, case: str) -> None:
    """One case as the launch names it: MODEL:DTYPE:TP,PP,EP[:replay]."""
    model, dtype, sizes, *replay = case.split(":")
    tp, pp, ep = (int(size) for size in sizes.split(","))
    run = run_replay_case if replay == ["replay"] else run_case
    run(ckpt_root, out_dir, model, dtype, tp, pp, ep)
