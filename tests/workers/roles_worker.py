"""torchrun worker for the role tests: at each (TP, PP) layout given, score and train the actor, reference and
critic on one fixed batch and save what the test compares (metrics, log-probs, full HF-named weights).

Run by tests/test_layout_invariance.py as `roles_worker CKPT_ROOT HF_DIR OUT_DIR DTYPE TP,PP [TP,PP ...]`, with
CKPT_ROOT/tp{TP}pp{PP} converted beforehand; the roles run in DTYPE (fp32, bf16, fp16).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from verl_mega.parallel.process_exit import exit_process


BATCH, PROMPT, RESPONSE = 8, 6, 5
PROMPT_LENGTHS = [6, 3, 4, 1, 5, 2, 6, 4]
RESPONSE_LENGTHS = [5, 2, 1, 5, 3, 4, 5, 1]
MICRO_BATCH, MINI_BATCH = 2, 4
# Each further policy loss trains its own actor on the batch, at these layouts only (fp32), with knobs that make
# its special cases happen on this small batch: clip_cov and kl_cov select 20% of a micro-batch's tokens among
# all covariances; gpg runs Dr. GRPO's constant normalisation.
LOSS_LAYOUTS = {(1, 1, 1), (2, 2, 2)}
POLICY_LOSS_CASES = {
    "gspo": dict(loss_agg_mode="seq-mean-token-mean", clip_ratio=0.05),
    "cispo": dict(clip_ratio=0.1),
    "geo_mean": dict(loss_agg_mode="seq-mean-token-mean"),
    "sapo": dict(loss_agg_mode="seq-mean-token-mean"),
    "clip_cov": dict(clip_cov_ratio=0.2, clip_cov_lb=-100.0, clip_cov_ub=100.0),
    "kl_cov": dict(kl_cov_ratio=0.2, ppo_kl_coef=1.0),
    "gpg": dict(loss_agg_mode="seq-mean-token-sum-norm"),
}
# The rollout correction on the vanilla loss, at the same layouts: token-level TIS capped at 1.1 and IcePop's
# token band [0.8, 1.25] (k1 bounds 0.8_1.25: ρ in [1/1.25, 1/0.8]), against rollout log-probs that are the old ones with noise, so the cap truncates and
# the band rejects some tokens of this batch.
CORRECTION_CASES = {
    "vanilla+rollout_correction": dict(rollout_is="token", rollout_is_threshold=1.1, rollout_rs="token_k1",
                                       rollout_rs_threshold="0.8_1.25"),
}
ROLLOUT_NOISE = 0.2
# At (2,2,2) gpg's micro-batches are grouped by a token budget of one full row instead: one row each, trimmed to
# its own response length, so Dr. GRPO's constant is compared across micro-batches cut differently.
TOKEN_BUDGET_CASES = {"gpg": PROMPT + RESPONSE}


def fixed_batch(vocab_size: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of different lengths; same on every rank."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab_size, (BATCH, PROMPT), generator=generator)
    responses = torch.randint(3, vocab_size, (BATCH, RESPONSE), generator=generator)
    prompt_mask = torch.arange(PROMPT)[None] >= PROMPT - torch.tensor(PROMPT_LENGTHS)[:, None]
    response_mask = torch.arange(RESPONSE)[None] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    prompts = prompts.masked_fill(~prompt_mask, pad_id)
    responses = responses.masked_fill(~response_mask, pad_id)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp_min(0),
        "responses": responses,
        "response_mask": response_mask.float(),
    }


def hf_response_logprobs(hf_dir: Path, batch, temperature: float = 1.0) -> torch.Tensor:
    """The responses' log-probs under transformers' forward of `hf_dir`, on logits / temperature."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    logits = logits[:, -RESPONSE - 1:-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, batch["responses"][..., None])[..., 0]


def gather_hf_weights(module, cfg, family) -> dict[str, torch.Tensor] | None:
    """This PP stage's weights as full HF tensors, every expert's included (on TP rank 0; None elsewhere)."""
    from megatron.core import parallel_state as ps

    from verl_mega.models.sharding import rank_slots, split_mcore_to_hf, strip_vocab_padding
    from verl_mega.models.spec import canonical_names
    from verl_mega.parallel.state import current_layout

    layout = current_layout()
    state_dict = module.state_dict()
    local = {canonical: state_dict[name] for name, canonical in canonical_names(state_dict).items()}
    weights = {}
    for slot in rank_slots(cfg, family, layout.pp_rank, layout.pp, layout.ep_rank, layout.ep):
        if slot.is_tied_copy:
            continue
        shard = local[slot.local_name].detach().float().contiguous()
        shards = [torch.empty_like(shard) for _ in range(layout.tp)]
        dist.all_gather(shards, shard, group=ps.get_tensor_model_parallel_group())
        for name, tensor in split_mcore_to_hf(slot, cfg, shards):
            weights[name] = strip_vocab_padding(slot.rule, tensor, cfg.vocab_size).clone()
    if layout.ep > 1:  # each expert-parallel rank holds its own experts (and copies of the rest)
        parts = [None] * layout.ep
        dist.all_gather_object(parts, weights, group=ps.get_expert_model_parallel_group())
        weights = {name: tensor for part in parts for name, tensor in part.items()}
    return weights if layout.tp_rank == 0 else None


def run_layout(ckpt_root: Path, hf_dir: Path, out_dir: Path, dtype: str, tp: int, pp: int) -> None:
    from verl_mega.models import HFModelConfig, family_for
    from verl_mega.checkpoint.manifest import Manifest
    from verl_mega.parallel.state import current_layout, init_parallel
    from verl_mega.config import OptimConfig, PolicyLossConfig, RolloutCorrectionConfig, ValueLossConfig
    from verl_mega.roles.actor import Actor
    from verl_mega.roles.critic import Critic
    from verl_mega.roles.reference import make_reference

    layout = init_parallel(tp, pp)
    ckpt = ckpt_root / f"tp{tp}pp{pp}"
    manifest = Manifest.read(ckpt)
    cfg = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(cfg)
    batch = fixed_batch(cfg.vocab_size, pad_id=0)
    hf_logprobs = hf_response_logprobs(hf_dir, batch)
    noise = torch.Generator().manual_seed(1)
    batch["old_log_probs"] = hf_logprobs + 0.3 * torch.randn(hf_logprobs.shape, generator=noise)
    batch["advantages"] = torch.randn(hf_logprobs.shape, generator=noise)
    batch["returns"] = torch.randn(hf_logprobs.shape, generator=noise)
    batch["values"] = torch.zeros_like(hf_logprobs)

    # Adam's first steps move weights by about lr whatever the gradient, which would hide gradient errors
    # from the weight comparison; large eps makes the update follow the gradient's size.
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0, adam_eps=1e-2,
                        use_distributed_optimizer=layout.dp > 1)
    reference = make_reference(ckpt, use_kl=True, dtype=dtype)
    batch["ref_log_probs"] = reference.compute_ref_log_prob(batch, MICRO_BATCH)
    actor = Actor(ckpt, optim, PolicyLossConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1),
                  schedule_steps=4, dtype=dtype)
    scored = actor.compute_log_prob(batch, MICRO_BATCH, return_entropy=True)
    actor_metrics = actor.update_policy(batch, ppo_epochs=1, mini_batch_size=MINI_BATCH,
                                        micro_batch_size=MICRO_BATCH)
    weights = gather_hf_weights(actor.model.module, cfg, family)

    critic = Critic(ckpt, optim, ValueLossConfig(cliprange_value=0.5), schedule_steps=4, dtype=dtype)
    initial_values = critic.compute_values(batch, MICRO_BATCH)
    critic_metrics = [critic.update_critic(batch, ppo_epochs=1, mini_batch_size=BATCH, micro_batch_size=MICRO_BATCH)
                      for _ in range(3)]

    layout = current_layout()
    loss_updates = {}
    if (tp, pp, layout.dp) in LOSS_LAYOUTS and dtype == "fp32":
        for name, knobs in POLICY_LOSS_CASES.items():
            loss_actor = Actor(ckpt, optim, PolicyLossConfig(policy_loss=name, **knobs), schedule_steps=4, dtype=dtype)
            metrics = loss_actor.update_policy(batch, ppo_epochs=1, mini_batch_size=MINI_BATCH,
                                               micro_batch_size=MICRO_BATCH,
                                               max_tokens=TOKEN_BUDGET_CASES.get(name, 0) if layout.dp > 1 else 0)
            updated = gather_hf_weights(loss_actor.model.module, cfg, family)
            loss_updates[name] = {"metrics": metrics, "weights": updated}
        rollout_noise = torch.randn(hf_logprobs.shape, generator=torch.Generator().manual_seed(2))
        corrected_batch = {**batch, "rollout_log_probs": batch["old_log_probs"] + ROLLOUT_NOISE * rollout_noise}
        for name, correction in CORRECTION_CASES.items():
            corrected = Actor(ckpt, optim, PolicyLossConfig(), schedule_steps=4, dtype=dtype,
                              correction=RolloutCorrectionConfig(**correction))
            metrics = corrected.update_policy(corrected_batch, ppo_epochs=1, mini_batch_size=MINI_BATCH,
                                              micro_batch_size=MICRO_BATCH)
            loss_updates[name] = {"metrics": metrics, "weights": gather_hf_weights(corrected.model.module, cfg, family)}
    result = {
        "hf_log_probs": hf_logprobs, "ref_log_probs": batch["ref_log_probs"], "log_probs": scored["log_probs"],
        "entropy": scored["entropy"], "response_mask": batch["response_mask"], "actor_metrics": actor_metrics,
        "initial_values": initial_values, "critic_metrics": critic_metrics, "weights": weights,
        "loss_updates": loss_updates,
    }
    if layout.tp_rank == 0 and layout.dp_rank == 0:
        torch.save(result, out_dir / f"tp{tp}pp{pp}dp{layout.dp}_stage{layout.pp_rank}.pt")
    dist.barrier()


def main(argv: list[str]) -> None:
    ckpt_root, hf_dir, out_dir, dtype, *layouts = argv
    for layout in layouts:
        tp, pp = (int(size) for size in layout.split(","))
        run_layout(Path(ckpt_root), Path(hf_dir), Path(out_dir), dtype, tp, pp)
    from verl_mega.parallel.state import destroy_parallel

    destroy_parallel()


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
