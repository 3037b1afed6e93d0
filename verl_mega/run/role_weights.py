"""Save a trained role's current weights as a Megatron-LM checkpoint (at the training layout) for export.

A LoRA role's weights are written merged, W + scale * B @ A for each adapted linear, without the adapters: the
final weights are a plain model that every reader (export, verify, `load_policy`) loads. Its adapters as a PEFT
folder come from a step checkpoint (`verl-mega export --step N`).
"""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from verl_mega.checkpoint import megatron_legacy
from verl_mega.checkpoint.manifest import HF_ASSETS_DIR, Manifest
from verl_mega.checkpoint.roles import check_role, has_lm_head
from verl_mega.files.atomic import collective_output_dir
from verl_mega.models.builder import dtype_name, unwrap_model
from verl_mega.models.lora import lora_modules, merged_weight
from verl_mega.models.spec import canonical_names
from verl_mega.parallel.layout import ParallelLayout


def save_role_weights(model, source_ckpt: Path, out: Path, layout: ParallelLayout, iteration: int,
                      role: str = "actor") -> None:
    """Collective: the DP-rank-0 replicas (CP rank 0 of them: CP ranks hold the same weights) write their shards
    into a temp folder that rank 0 publishes as `out`.

    `source_ckpt` is the checkpoint the role was loaded from (config, vocab padding, tokenizer files).
    A critic's shards hold its value head where the actor's hold the LM head, so nothing is tied.
    """
    check_role(role)
    source = Manifest.read(source_ckpt)
    model = unwrap_model(model)
    with collective_output_dir(out, layout.rank) as tmp:
        if layout.dp_rank == 0 and layout.cp_rank == 0:
            local = _plain_state_dict(model)
            state_dict = {canonical: local[name].detach().cpu() for name, canonical in canonical_names(local).items()}
            coords = dict(tp_rank=layout.tp_rank, pp_rank=layout.pp_rank, pp=layout.pp, ep_rank=layout.ep_rank,
                          ep=layout.ep)
            megatron_legacy.write_shard(tmp, iteration, coords, state_dict, args={})
        if layout.rank == 0:
            replace(source, format="megatron_legacy", iteration=iteration, role=role, vpp=layout.vpp,
                    dtype=dtype_name(model.config.params_dtype),
                    tied_embeddings=source.tied_embeddings and has_lm_head(role)).write(tmp)
            megatron_legacy.write_tracker(tmp, iteration)
            shutil.copytree(source_ckpt / HF_ASSETS_DIR, tmp / HF_ASSETS_DIR)


def _plain_state_dict(model) -> dict:
    """The model's state dict, each adapted linear's weight merged with its adapters and the adapters left out."""
    state = model.state_dict()
    for info in lora_modules(model):
        linear = model.get_submodule(info.name)
        state[f"{info.name}.weight"] = merged_weight(linear.weight.detach(), linear.lora_a.detach(),
                                                     linear.lora_b.detach(), info.scale)
        del state[f"{info.name}.lora_a"], state[f"{info.name}.lora_b"]
    return state
