"""HF checkpoint -> Megatron shards, one rank at a time, reading only each rank's slices."""
from __future__ import annotations

from pathlib import Path

import torch

from verl_mega.checkpoint import megatron_legacy
from verl_mega.checkpoint.hf_assets import check_json_assets, copy_hf_assets, without_remote_code
from verl_mega.checkpoint.manifest import HF_ASSETS_DIR, Manifest
from verl_mega.checkpoint.model_io import hf_rank_shard_plan, open_hf_checkpoint
from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.checkpoint.unread_tensors import is_carried, write_unread_tensors
from verl_mega.files.atomic import atomic_output_dir
from verl_mega.models import load_hf_model_config
from verl_mega.models.builder import DTYPES, architecture, padded_vocab_size
from verl_mega.models.expected_shapes import expected_hf_shapes
from verl_mega.models.spec import HF_EMBEDDING, HF_LM_HEAD
from verl_mega.parallel.layout import check_model_fit

from .torch_dist import write_torch_dist

def convert_hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
                        dtype: str = "fp32", fmt: str = "megatron_legacy", overwrite: bool = False,
                        make_vocab_size_divisible_by: int = 128, keep_remote_code: bool = False,
                        family_spec: str | None = None) -> Manifest:
    """`family_spec` ("package.module:SPEC") declares the family instead of the built-in ones and plugins."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    hf_config, family = load_hf_model_config(hf_dir, family_spec)
    check_model_fit(hf_config, tp, pp, ep, names={"tp": "--tp", "pp": "--pp", "ep": "--ep"})
    check_json_assets(hf_dir)
    reader = open_hf_checkpoint(hf_dir, hf_config, family)
    carried = check_hf_tensors(reader, hf_config, family)
    padded_vocab = padded_vocab_size(hf_config.vocab_size, tp, make_vocab_size_divisible_by)
    manifest = Manifest(
        family=family.name, hf_config=hf_config.raw if keep_remote_code else without_remote_code(hf_config.raw),
        format=fmt,
        tp=tp, pp=pp, ep=ep, dtype=dtype,
        tied_embeddings=hf_config.tie_word_embeddings, padded_vocab_size=padded_vocab, family_spec=family.origin,
        unread_tensors=carried,
    )
    with atomic_output_dir(out_dir, overwrite, sources=(hf_dir,)) as tmp:
        if fmt == "megatron_legacy":
            _write_legacy_shards(tmp, reader, hf_config, family, manifest)
        elif fmt == "torch_dist":
            write_torch_dist(tmp, hf_dir, manifest)
        else:
            raise ValueError(f"--format must be megatron_legacy or torch_dist, got '{fmt}'")
        copy_hf_assets(hf_dir, tmp / HF_ASSETS_DIR, keep_remote_code=keep_remote_code)
        write_unread_tensors(reader, carried, tmp / HF_ASSETS_DIR)
        manifest.write(tmp)
    return manifest


def _write_legacy_shards(root: Path, reader, hf_config, family, manifest: Manifest) -> None:
    args = megatron_args(hf_config, family, manifest)
    for pp_rank in range(manifest.pp):
        for ep_rank in range(manifest.ep):
            for tp_rank in range(manifest.tp):
                state_dict, streamed = hf_rank_shard_plan(reader, hf_config, family, manifest, tp_rank, pp_rank,
                                                          ep_rank)
                coords = dict(tp_rank=tp_rank, pp_rank=pp_rank, pp=manifest.pp, ep_rank=ep_rank, ep=manifest.ep)
                megatron_legacy.write_shard(root, manifest.iteration, coords, state_dict, args, streamed)
                del state_dict
    megatron_legacy.write_tracker(root, manifest.iteration)


# Megatron-LM's names for the `architecture` fields its loader checks, where they differ from megatron-core's.
_MEGATRON_LM_NAMES = {"gated_linear_unit": "swiglu", "num_moe_experts": "num_experts"}
_RECORDED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "normalization", "gated_linear_unit", "add_qkv_bias", "qk_layernorm", "num_moe_experts",
             "moe_router_topk")


def megatron_args(hf_config, family, manifest: Manifest) -> dict:
    """The subset of Megatron-LM's arguments its loader checks against the running job."""
    shape = architecture(hf_config, family)
    return dict(
        {_MEGATRON_LM_NAMES.get(name, name): shape[name] for name in _RECORDED if name in shape},
        tensor_model_parallel_size=manifest.tp, pipeline_model_parallel_size=manifest.pp,
        expert_model_parallel_size=manifest.ep, group_query_attention=hf_config.num_kv_heads != hf_config.num_heads,
        max_position_embeddings=hf_config.max_position_embeddings, padded_vocab_size=manifest.padded_vocab_size,
        untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings, position_embedding_type="rope",
        rotary_base=hf_config.rope_theta, params_dtype=manifest.dtype,
    )


def check_hf_tensors(reader: SafetensorsReader, hf_config, family) -> list[str]:
    """Refuse, before anything is written, a checkpoint whose tensors are not those its config.json implies; returns
    the names of those it carries that the model does not read and the export writes back (`unread_tensors`)."""
    expected = expected_hf_shapes(hf_config, family)
    unread = [name for name in reader.names() if name not in expected]
    carried = sorted(name for name in unread if is_carried(name, hf_config, family))
    problems = [f"tensor '{name}' is missing" for name in expected if name not in reader]
    problems += [f"tensor '{name}' has shape {list(reader.shape(name))}, config.json implies {list(shape)}"
                 for name, shape in expected.items() if name in reader and tuple(reader.shape(name)) != shape]
    problems += [f"tensor '{name}' has dtype {reader.dtype(name)}, not a floating-point type"
                 for name in expected if name in reader and not reader.dtype(name).is_floating_point]
    problems += [f"tensor '{name}' is not part of a {family.name} model with this config"
                 for name in unread if name not in carried]
    if HF_LM_HEAD in carried and HF_EMBEDDING in expected \
            and reader.shape(HF_LM_HEAD) == reader.shape(HF_EMBEDDING) \
            and not torch.equal(reader.read(HF_LM_HEAD), reader.read(HF_EMBEDDING)):
        problems.append("tensor 'lm_head.weight' differs from the embedding, but config.json says "
                        "tie_word_embeddings=true (the LM head would be replaced by the embedding)")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise ValueError(f"the checkpoint at {reader.dir} does not match its config.json: {problems[0]}{more}")
    return carried

