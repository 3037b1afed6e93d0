"""Megatron shards -> an HF folder that `transformers` loads, one tensor at a time.

An actor checkpoint becomes a `*ForCausalLM` model; a critic checkpoint (manifest role "critic") the
matching `*ForTokenClassification` model with one label, its value head as `score`: same backbone
tensors, through the same family spec.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from verl_mega.checkpoint import megatron_legacy
from verl_mega.checkpoint.hf_assets import copy_hf_assets, without_remote_code
from verl_mega.checkpoint.manifest import HF_ASSETS_DIR, Manifest
from verl_mega.checkpoint.roles import head_rules, hf_architecture
from verl_mega.checkpoint.safetensors_io import SafetensorsWriter
from verl_mega.checkpoint.torch_dist import DIST_DIR, iter_torch_dist_hf_tensors
from verl_mega.checkpoint.unread_tensors import open_unread_tensors
from verl_mega.files.atomic import atomic_output_dir
from verl_mega.models import HFModelConfig, family_for
from verl_mega.models.builder import DTYPES
from verl_mega.models.expected_shapes import mcore_shard_shape
from verl_mega.models.sharding import fp32_hf_names, rank_slots, split_mcore_to_hf, strip_vocab_padding
from verl_mega.models.spec import HF_EMBEDDING, HF_LM_HEAD

HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def convert_mcore_to_hf(ckpt_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None,
                        overwrite: bool = False, max_shard_bytes: int = 2 * 1024**3,
                        keep_remote_code: bool = False, family_spec: str | None = None) -> Path:
    """`family_spec` replaces the family spec the manifest records (e.g. after its module moved)."""
    manifest = Manifest.read(ckpt_dir, family_spec)
    return write_hf_model(iter_checkpoint_hf_tensors(ckpt_dir, manifest), manifest, Path(ckpt_dir) / HF_ASSETS_DIR, out_dir, sources=(ckpt_dir,),
                          dtype=dtype, overwrite=overwrite, max_shard_bytes=max_shard_bytes,
                          keep_remote_code=keep_remote_code)


def iter_checkpoint_hf_tensors(ckpt_dir: str | Path, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of a converted checkpoint or a role's final weights, in either format."""
    if manifest.format == "torch_dist":
        return iter_torch_dist_hf_tensors(Path(ckpt_dir) / DIST_DIR, manifest)
    return iter_legacy_hf_tensors(ckpt_dir, manifest)


def write_hf_model(tensors: Iterator[tuple[str, torch.Tensor]], manifest: Manifest, assets: Path,
                   out_dir: str | Path, *, sources: tuple[str | Path, ...], dtype: str | None = None,
                   overwrite: bool = False, max_shard_bytes: int = 2 * 1024**3, keep_remote_code: bool = False) -> Path:
    """Write an HF folder from (HF name, tensor) pairs (read lazily, inside the temp folder's lifetime), and the
    tensors the model does not read that `assets` carries, as they are."""
    dtype = dtype or manifest.dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    hf_config = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(hf_config, manifest.family_spec, recorded=True)
    kept_fp32 = fp32_hf_names(hf_config, family)
    carried = open_unread_tensors(assets, manifest, hf_config, family)
    # A tied LM head the source stored is the embedding: written as the exported one, where the export has the head.
    tied_head = manifest.tied_embeddings and HF_LM_HEAD in (manifest.unread_tensors or ())
    with atomic_output_dir(out_dir, overwrite, sources=sources) as tmp:
        writer = SafetensorsWriter(tmp, max_shard_bytes)
        for name, tensor in tensors:
            written = _finite(name, tensor, tensor.to(torch.float32 if name in kept_fp32 else DTYPES[dtype]), dtype)
            writer.add(name, written)
            if tied_head and name == HF_EMBEDDING:
                writer.add(HF_LM_HEAD, written.clone())  # safetensors stores no shared tensors
        for name in carried.names() if carried is not None else ():
            writer.add(name, carried.read(name))
        writer.close()
        _write_hf_files(assets, manifest, tmp, dtype, keep_remote_code)
    return Path(out_dir)


def _finite(name: str, tensor: torch.Tensor, written: torch.Tensor, dtype: str) -> torch.Tensor:
    """`written` (tensor in the output dtype) if every value is finite; weights that are NaN/inf, or overflow the
    output dtype, are refused before anything is written, as the trainer refuses to save them."""
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"tensor '{name}' holds NaN/inf: these weights are not a model, nothing was written "
                         "(export an earlier checkpoint: --step N)")
    if not bool(torch.isfinite(written).all()):
        raise ValueError(f"tensor '{name}' overflows {dtype} (largest |value| {tensor.abs().max().item():.4g}): "
                         "nothing was written; export in a wider --dtype (bf16 or fp32)")
    return written


def iter_legacy_hf_tensors(ckpt_dir: str | Path, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every tensor, holding one pipeline stage's files memory-mapped."""
    hf_config = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(hf_config, manifest.family_spec, ckpt_dir, recorded=True)
    iteration = megatron_legacy.checked_iteration(ckpt_dir, manifest.iteration, manifest.tp, manifest.pp, manifest.ep)
    for pp_rank in range(manifest.pp):
        for ep_rank in range(manifest.ep):
            shards = [
                megatron_legacy.read_shard(ckpt_dir, iteration, tp_rank=tp_rank, pp_rank=pp_rank, pp=manifest.pp,
                                           ep_rank=ep_rank, ep=manifest.ep)
                for tp_rank in range(manifest.tp)
            ]
            slots = list(rank_slots(hf_config, family, pp_rank, manifest.pp, ep_rank, manifest.ep,
                                    head_rules(manifest.role), manifest.vpp))
            for tp_rank, shard in enumerate(shards):
                where = f"the shard of tp_rank {tp_rank}, pp_rank {pp_rank}, ep_rank {ep_rank} in {ckpt_dir}"
                _check_shard(shard, slots, hf_config, manifest, where)
            for slot in slots:
                if slot.is_tied_copy or (ep_rank > 0 and not slot.rule.per_expert):
                    continue
                for name, tensor in split_mcore_to_hf(slot, hf_config, [shard[slot.local_name] for shard in shards]):
                    yield name, strip_vocab_padding(slot.rule, tensor, hf_config.vocab_size)
            del shards


def _check_shard(shard: dict, slots, hf_config, manifest: Manifest, where: str) -> None:
    """Refuse a shard whose tensors are not those the manifest's config and layout imply (a manifest that
    disagrees with the files would otherwise export tensors of the wrong size)."""
    expected = {slot.local_name: mcore_shard_shape(slot, hf_config, manifest.tp, manifest.padded_vocab_size)
                for slot in slots}
    for name, shape in expected.items():
        if name not in shard:
            raise ValueError(f"tensor '{name}' is missing from {where}: the files do not match the manifest "
                             f"(tp={manifest.tp}, pp={manifest.pp}, ep={manifest.ep})")
        if tuple(shard[name].shape) != shape or not shard[name].is_floating_point():
            raise ValueError(f"tensor '{name}' in {where} is {shard[name].dtype} {list(shard[name].shape)}, the "
                             f"manifest (tp={manifest.tp}, its hf_config) implies a floating-point {list(shape)}")
    unexpected = sorted(set(shard) - set(expected))
    if unexpected:
        raise ValueError(f"{where} holds tensor '{unexpected[0]}', which the manifest's model lacks")


def _write_hf_files(assets: Path, manifest: Manifest, out: Path, dtype: str, keep_remote_code: bool) -> None:
    if assets.is_dir():
        copy_hf_assets(assets, out, keep_remote_code=keep_remote_code, skip=("config.json",), follow_symlinks=False)
    family = family_for(manifest.hf_config, manifest.family_spec, assets.parent, recorded=True)
    config = dict(manifest.hf_config if keep_remote_code else without_remote_code(manifest.hf_config))
    config["architectures"] = [hf_architecture(family, manifest.role)]
    if manifest.role == "critic":
        # One label: the value. transformers stores num_labels as the label maps.
        config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    # The tie flag comes from the manifest (what the shards were built with), never from a hand-set flag.
    config["tie_word_embeddings"] = manifest.tied_embeddings
    dtype_key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
    config[dtype_key] = HF_DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
