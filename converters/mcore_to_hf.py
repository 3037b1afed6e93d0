"""Megatron shards -> an HF folder that `transformers` loads, one tensor at a time.

An actor checkpoint becomes a `*ForCausalLM` model; a critic checkpoint (manifest role "critic") the
matching `*ForTokenClassification` model with one label, its value head as `score`: same backbone
tensors, through the same family spec.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import torch

from verl_mega.checkpoint import megatron_legacy
from verl_mega.checkpoint.atomic import atomic_output_dir
from verl_mega.checkpoint.manifest import HF_ASSETS_DIR, Manifest
from verl_mega.checkpoint.roles import head_rules, hf_architecture
from verl_mega.checkpoint.safetensors_io import SafetensorsWriter
from verl_mega.checkpoint.torch_dist import iter_torch_dist_hf_tensors
from verl_mega.models import HFModelConfig, family_for
from verl_mega.models.builder import DTYPES
from verl_mega.models.sharding import rank_slots, split_mcore_to_hf, strip_vocab_padding

HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def convert_mcore_to_hf(ckpt_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None,
                        overwrite: bool = False, max_shard_bytes: int = 2 * 1024**3) -> Path:
    manifest = Manifest.read(ckpt_dir)
    dtype = dtype or manifest.dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    if manifest.format == "torch_dist":
        if manifest.role != "actor":
            raise ValueError(f"{ckpt_dir}: only actor checkpoints are read in torch_dist format; save the "
                             f"{manifest.role} as megatron_legacy (`save_role_weights` does)")
        iter_tensors = iter_torch_dist_hf_tensors
    else:
        iter_tensors = iter_legacy_hf_tensors
    with atomic_output_dir(out_dir, overwrite) as tmp:
        writer = SafetensorsWriter(tmp, max_shard_bytes)
        for name, tensor in iter_tensors(ckpt_dir, manifest):
            writer.add(name, tensor.to(DTYPES[dtype]))
        writer.close()
        _write_hf_files(Path(ckpt_dir), manifest, tmp, dtype)
    return Path(out_dir)


def iter_legacy_hf_tensors(ckpt_dir: str | Path, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every tensor, holding one pipeline stage's files memory-mapped."""
    cfg = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(cfg)
    tracker = Path(ckpt_dir) / megatron_legacy.TRACKER_NAME
    iteration = int(tracker.read_text().strip()) if tracker.is_file() else manifest.iteration
    for pp_rank in range(manifest.pp):
        for ep_rank in range(manifest.ep):
            shards = [
                megatron_legacy.read_shard(ckpt_dir, iteration, tp_rank=tp_rank, pp_rank=pp_rank, pp=manifest.pp,
                                           ep_rank=ep_rank, ep=manifest.ep)
                for tp_rank in range(manifest.tp)
            ]
            for slot in rank_slots(cfg, family, pp_rank, manifest.pp, ep_rank, manifest.ep,
                                   head_rules(manifest.role)):
                if slot.is_tied_copy or (ep_rank > 0 and not slot.rule.per_expert):
                    continue
                missing = [r for r, shard in enumerate(shards) if slot.local_name not in shard]
                if missing:
                    raise ValueError(
                        f"tensor '{slot.local_name}' is missing from the shard of tp_rank {missing[0]}, pp_rank "
                        f"{pp_rank} in {ckpt_dir}: the files do not match the manifest's layout "
                        f"(tp={manifest.tp}, pp={manifest.pp}, ep={manifest.ep})"
                    )
                for name, tensor in split_mcore_to_hf(slot, cfg, [shard[slot.local_name] for shard in shards]):
                    yield name, strip_vocab_padding(slot.rule, tensor, cfg.vocab_size)
            del shards


def _write_hf_files(ckpt_dir: Path, manifest: Manifest, out: Path, dtype: str) -> None:
    assets = ckpt_dir / HF_ASSETS_DIR
    if assets.is_dir():
        for path in assets.iterdir():
            if path.is_file() and path.name != "config.json":
                shutil.copy2(path, out / path.name)
    family = family_for(manifest.hf_config)
    config = dict(manifest.hf_config)
    config["architectures"] = [hf_architecture(family, manifest.role)]
    if manifest.role == "critic":
        # One label: the value. transformers stores num_labels as the label maps.
        config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    # The tie flag comes from the manifest (what the shards were built with), never from a hand-set flag.
    config["tie_word_embeddings"] = manifest.tied_embeddings
    dtype_key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
    config[dtype_key] = HF_DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
