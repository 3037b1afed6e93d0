"""megatron `dist_checkpointing` ("torch_dist") checkpoints: written at one layout, loadable at any.

Writing needs megatron's own sharded state dict, so it runs under torchrun at the target layout: each
rank streams its shard from the HF files into its model and saves. Reading back to HF needs no model:
each stored key is one full (TP-merged) tensor stacked over layers (and experts), loaded key by key.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterator

import torch

from verl_mega.checkpoint.manifest import Manifest
from verl_mega.models import HFModelConfig, family_for
from verl_mega.models.sharding import rank_slots, split_mcore_to_hf, strip_vocab_padding
from verl_mega.parallel.launch import run_torchrun

DIST_DIR = "iter_0000000"


def write_torch_dist(root: Path, hf_dir: str | Path, manifest: Manifest) -> None:
    """Save a dist checkpoint of the HF model at `manifest`'s layout into root/iter_0000000."""
    manifest.write(root)  # the workers read the layout and the config from it
    run_torchrun(manifest.tp * manifest.pp * manifest.ep, "verl_mega.converters.torch_dist",
                 ["--hf", str(hf_dir), "--out", str(root)])


def _write_rank(hf_dir: Path, root: Path) -> None:
    from megatron.core import dist_checkpointing

    from verl_mega.checkpoint.safetensors_io import SafetensorsReader
    from verl_mega.models.builder import build_gpt_model, transformer_config
    from verl_mega.parallel.state import destroy_parallel, init_parallel

    from verl_mega.checkpoint.model_io import load_canonical_state_dict

    from .hf_to_mcore import rank_state_dict

    manifest = Manifest.read(root)
    cfg = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(cfg)
    layout = init_parallel(manifest.tp, manifest.pp, manifest.ep)
    config = transformer_config(cfg, family, tp=layout.tp, pp=layout.pp, ep=layout.ep, dtype=manifest.dtype)
    model = build_gpt_model(cfg, family, config, padded_vocab=manifest.padded_vocab_size,
                            pre_process=layout.is_first_stage, post_process=layout.is_last_stage)
    state_dict = rank_state_dict(SafetensorsReader(hf_dir), cfg, family, manifest, layout.tp_rank, layout.pp_rank,
                                 layout.ep_rank)
    load_canonical_state_dict(model, state_dict, family.moe, f"the converted shard of rank {layout.rank}")
    out = root / DIST_DIR
    out.mkdir(exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out))
    torch.distributed.barrier()
    destroy_parallel()


def load_torch_dist(model, ckpt_dir: str | Path) -> None:
    """Load a dist checkpoint into this rank's model, whatever layout it was saved at."""
    from megatron.core import dist_checkpointing

    path = Path(ckpt_dir) / DIST_DIR
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete dist checkpoint (metadata.json missing)")
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(path))
    model.load_state_dict(loaded, strict=False)


def iter_torch_dist_hf_tensors(ckpt_dir: str | Path, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every tensor, loading one stacked dist-checkpoint key at a time."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    _ensure_single_process_group()
    path = str(Path(ckpt_dir) / DIST_DIR)
    metadata = dist_checkpointing.load_tensors_metadata(path)
    cfg = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(cfg)
    current_key, stacked = None, None
    for slot in rank_slots(cfg, family):
        key, index = _dist_key(slot, metadata)
        if key != current_key:
            meta = metadata[key]
            request = {key: ShardedTensor.from_rank_offsets(key, torch.empty(meta.global_shape, dtype=meta.dtype))}
            current_key, stacked = key, dist_checkpointing.load(request, path)[key]
        tensor = stacked[index] if index else stacked
        for name, hf_tensor in split_mcore_to_hf(slot, cfg, [tensor]):
            yield name, strip_vocab_padding(slot.rule, hf_tensor, cfg.vocab_size)


def _dist_key(slot, metadata) -> tuple[str, tuple[int, ...]]:
    """The stored key of a slot and its index in the layer (and expert) axes."""
    rule_name = slot.rule.mcore
    key = rule_name.replace(".{layer}", "").replace("local_experts.{expert}", "experts")
    index = tuple(i for i in (slot.layer, slot.expert) if i is not None)
    # megatron's local spec saves an MoE layer's pre-MLP norm under the dense TE name.
    candidates = [key, key.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")]
    for candidate in candidates:
        if candidate in metadata:
            return candidate, index
    raise ValueError(f"dist checkpoint lacks '{key}' (for {slot.global_name}); it was written for another model")


def _ensure_single_process_group() -> None:
    import os

    if not torch.distributed.is_initialized():
        from verl_mega.parallel.launch import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="verl_mega.converters.torch_dist")
    parser.add_argument("--hf", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    _write_rank(Path(args.hf), Path(args.out))


if __name__ == "__main__":
    main()
