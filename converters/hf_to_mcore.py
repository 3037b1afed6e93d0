"""HF checkpoint -> Megatron shards, one rank at a time, reading only each rank's slices."""
from __future__ import annotations

import shutil
from pathlib import Path

from verl_mega.checkpoint import megatron_legacy
from verl_mega.checkpoint.atomic import atomic_output_dir
from verl_mega.checkpoint.manifest import HF_ASSETS_DIR, Manifest
from verl_mega.checkpoint.model_io import hf_rank_state_dict
from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.models import load_hf_model_config
from verl_mega.models.builder import DTYPES, architecture, padded_vocab_size
from verl_mega.models.sharding import rank_slots
from verl_mega.parallel.layout import check_model_fit

from .torch_dist import write_torch_dist

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".msgpack", ".h5")


def convert_hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
                        dtype: str = "fp32", fmt: str = "megatron_legacy", overwrite: bool = False,
                        make_vocab_size_divisible_by: int = 128) -> Manifest:
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    cfg, family = load_hf_model_config(hf_dir)
    check_model_fit(cfg, tp, pp, ep, names={"tp": "--tp", "pp": "--pp", "ep": "--ep"})
    reader = SafetensorsReader(hf_dir)
    _check_sources_present(reader, cfg, family)
    padded_vocab = padded_vocab_size(cfg.vocab_size, tp, make_vocab_size_divisible_by)
    manifest = Manifest(
        family=family.name, hf_config=cfg.raw, format=fmt, tp=tp, pp=pp, ep=ep, dtype=dtype,
        tied_embeddings=cfg.tie_word_embeddings, padded_vocab_size=padded_vocab,
    )
    with atomic_output_dir(out_dir, overwrite) as tmp:
        if fmt == "megatron_legacy":
            _write_legacy_shards(tmp, reader, cfg, family, manifest)
        elif fmt == "torch_dist":
            write_torch_dist(tmp, hf_dir, manifest)
        else:
            raise ValueError(f"--format must be megatron_legacy or torch_dist, got '{fmt}'")
        copy_hf_assets(hf_dir, tmp / HF_ASSETS_DIR)
        manifest.write(tmp)
    return manifest


def _write_legacy_shards(root: Path, reader, cfg, family, manifest: Manifest) -> None:
    args = megatron_args(cfg, family, manifest)
    for pp_rank in range(manifest.pp):
        for ep_rank in range(manifest.ep):
            for tp_rank in range(manifest.tp):
                state_dict = hf_rank_state_dict(reader, cfg, family, manifest, tp_rank, pp_rank, ep_rank)
                coords = dict(tp_rank=tp_rank, pp_rank=pp_rank, pp=manifest.pp, ep_rank=ep_rank, ep=manifest.ep)
                megatron_legacy.write_shard(root, manifest.iteration, coords, state_dict, args)
                del state_dict
    megatron_legacy.write_tracker(root, manifest.iteration)


# Megatron-LM's names for the `architecture` fields its loader checks, where they differ from megatron-core's.
_MEGATRON_LM_NAMES = {"gated_linear_unit": "swiglu", "num_moe_experts": "num_experts"}
_RECORDED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "normalization", "gated_linear_unit", "add_qkv_bias", "qk_layernorm", "num_moe_experts",
             "moe_router_topk")


def megatron_args(cfg, family, manifest: Manifest) -> dict:
    """The subset of Megatron-LM's arguments its loader checks against the running job."""
    shape = architecture(cfg, family)
    return dict(
        {_MEGATRON_LM_NAMES.get(name, name): shape[name] for name in _RECORDED if name in shape},
        tensor_model_parallel_size=manifest.tp, pipeline_model_parallel_size=manifest.pp,
        expert_model_parallel_size=manifest.ep, group_query_attention=cfg.num_kv_heads != cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings, padded_vocab_size=manifest.padded_vocab_size,
        untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, position_embedding_type="rope",
        rotary_base=cfg.rope_theta, params_dtype=manifest.dtype,
    )


def _check_sources_present(reader: SafetensorsReader, cfg, family) -> None:
    missing = [name for slot in rank_slots(cfg, family) for name in slot.hf_names if name not in reader]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"the {family.name} checkpoint at {reader.dir} lacks tensors its config implies: {shown}")
    embed_shape = reader.shape("model.embed_tokens.weight")
    if embed_shape != [cfg.vocab_size, cfg.hidden_size]:
        raise ValueError(
            f"model.embed_tokens.weight has shape {embed_shape}, but config.json says vocab_size={cfg.vocab_size}, "
            f"hidden_size={cfg.hidden_size}"
        )


def copy_hf_assets(src: str | Path, dst: Path) -> None:
    """Tokenizer, chat template and generation files: everything but weights."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in Path(src).iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, dst / path.name)
