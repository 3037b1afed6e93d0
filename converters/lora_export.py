"""A LoRA run's adapters out: a PEFT adapter folder, or merged into the frozen base as a plain HF folder.

One megatron linear's adapters are a pair of TP-merged tensors, A [rank, in] and B [out, rank]. Its HF modules
follow from the family spec's rule for the linear's weight: B's rows split exactly as the weight's rows do
(linear_qkv -> q/k/v un-interleaved per query group, linear_fc1 -> gate/up halves, a fused HF tensor such as
Phi-3's qkv_proj keeping them fused), while A is the same for each of them (every HF module multiplies the
linear's input). Biases (Qwen2's q/k/v) are never adapted: PEFT's `bias: "none"`, the bias comes from the base.

    OUT/adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules (HF names), ...
    OUT/adapter_model.safetensors   base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight, ...
    OUT/tokenizer files             the base's, so the folder is all a PEFT user needs besides the base
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from verl_mega.checkpoint.hf_assets import copy_hf_assets
from verl_mega.checkpoint.manifest import Manifest
from verl_mega.files.atomic import atomic_output_dir
from verl_mega.models import HFModelConfig, family_for
from verl_mega.models.builder import DTYPES
from verl_mega.models.expected_shapes import mcore_shape
from verl_mega.models.lora import merged_weight
from verl_mega.models.sharding import rank_slots, split_mcore_to_hf

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Adapters:
    """A role's trained adapters: `tensors` maps '<megatron module>.lora_a' / '.lora_b' (global layer numbers,
    canonical names) to the TP-merged tensor."""

    rank: int
    alpha: float
    dropout: float
    tensors: dict[str, torch.Tensor]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def hf_adapters(adapters: Adapters, hf_config: HFModelConfig, family) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF weight name, A, B's rows for that HF module) of every adapted HF module, in the family spec's order.
    Raises ValueError naming an adapter that fits no linear of the model, or has the wrong shape."""
    matched = set()
    for slot in rank_slots(hf_config, family):
        module = slot.global_name.removesuffix("weight")
        if not slot.global_name.endswith(".weight") or module + "lora_a" not in adapters.tensors:
            continue
        a, b = adapters.tensors[module + "lora_a"], adapters.tensors.get(module + "lora_b")
        out_features, in_features = mcore_shape(slot.rule, hf_config)
        for name, tensor, want in ((module + "lora_a", a, (adapters.rank, in_features)),
                                   (module + "lora_b", b, (out_features, adapters.rank))):
            if tensor is None or tuple(tensor.shape) != want or not tensor.is_floating_point():
                found = "missing" if tensor is None else f"{tensor.dtype} {list(tensor.shape)}"
                raise ValueError(f"adapter '{name}' is {found}; rank {adapters.rank} on that linear needs a "
                                 f"floating-point {list(want)}")
        matched.update((module + "lora_a", module + "lora_b"))
        for hf_name, rows in split_mcore_to_hf(slot, hf_config, [b]):
            yield hf_name, a, rows
    stray = sorted(set(adapters.tensors) - matched)
    if stray:
        raise ValueError(f"adapter '{stray[0]}' belongs to no linear of this {family.name} model")


def merged_hf_tensors(tensors: Iterator[tuple[str, torch.Tensor]], deltas: dict[str, tuple[torch.Tensor, torch.Tensor]],
                      scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The base's HF tensors with W + scale * B @ A (in fp32) where `deltas` (HF name -> (A, B rows)) has one.
    Merging after the split equals merging the megatron tensor: B's row split is a permutation of W's rows."""
    for name, tensor in tensors:
        if name in deltas:
            a, b = deltas[name]
            tensor = merged_weight(tensor.float(), a, b, scale)
        yield name, tensor


def write_peft_folder(adapters: Adapters, manifest: Manifest, assets: Path, out: str | Path, *, base_model: str,
                      sources: tuple[str | Path, ...], dtype: str | None = None, overwrite: bool = False) -> Path:
    """Write `adapters` as a PEFT LoRA folder for the base model `manifest` describes (`base_model`: its name or
    path, recorded as base_model_name_or_path); nothing is written if any tensor is refused."""
    dtype = dtype or manifest.dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    hf_config = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(hf_config, manifest.family_spec, recorded=True)
    tensors, targets = {}, set()
    for hf_name, a, b in hf_adapters(adapters, hf_config, family):
        module = hf_name.removesuffix(".weight")
        targets.add(module.rpartition(".")[2])
        for kind, tensor in (("lora_A", a), ("lora_B", b)):
            name = f"{_PEFT_PREFIX}{module}.{kind}.weight"
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"adapter tensor '{name}' holds NaN/inf: nothing was written (export an earlier "
                                 "checkpoint: --step N)")
            # A is shared by the HF modules of one megatron linear; safetensors stores each name's own copy.
            tensors[name] = tensor.to(DTYPES[dtype]).contiguous().clone()
    if not tensors:
        raise ValueError("the checkpoint holds no adapters: nothing to write as a PEFT folder")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": adapters.rank, "lora_alpha": adapters.alpha, "lora_dropout": adapters.dropout,
        "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
    }
    with atomic_output_dir(out, overwrite, sources=sources) as tmp:
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
        (tmp / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if assets.is_dir():
            copy_hf_assets(assets, tmp, skip=("config.json",), follow_symlinks=False)
    return Path(out)
