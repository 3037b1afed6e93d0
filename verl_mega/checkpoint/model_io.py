"""Converted checkpoints <-> this rank's megatron-core model: a rank's shard from the HF files, and loading a
checkpoint (either format) into the model at the running job's layout."""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from verl_mega.config.errors import UserError
from verl_mega.models import HFModelConfig, family_for
from verl_mega.models.builder import DTYPES, build_rank_model, transformer_config
from verl_mega.models.sharding import merge_hf_to_mcore, rank_slots, shard_pieces
from verl_mega.models.spec import LAYER, FamilySpec, canonical_names
from verl_mega.parallel.state import current_layout

from . import megatron_legacy
from .manifest import Manifest
from .roles import head_rules
from .safetensors_io import SafetensorsReader
from .torch_dist import load_torch_dist


def open_hf_checkpoint(hf_dir: str | Path, hf_config: HFModelConfig, family: FamilySpec) -> SafetensorsReader:
    """A reader of an HF checkpoint under the names the family's rules use, whichever spelling the files use for
    the experts: one tensor per expert (transformers 4.x, and 5.x's `save_pretrained`) or the family's expert
    stacks (transformers 5's in-memory spelling), split into per-expert tensors without reading them. The layers
    after the last that the model does not read (`FamilySpec.unread_layers`) are split alike, so that an export
    writes every layer in one spelling."""
    reader = SafetensorsReader(hf_dir)
    unread = [True] * family.unread_layer_count(hf_config)
    for layer, is_moe in enumerate(family.moe_layer_pattern(hf_config) + unread):
        for stack in family.expert_stacks if is_moe else ():
            stacked = stack.stacked.replace(LAYER, str(layer))
            if stacked not in reader:
                continue
            shape = reader.shape(stacked)
            if len(shape) != 3 or shape[0] != hf_config.num_experts:
                raise ValueError(f"the checkpoint at {reader.dir}: tensor '{stacked}' has shape {shape}, not "
                                 f"[{hf_config.num_experts} experts, rows, columns] as config.json implies")
            reader.split_rows(stacked, stack.part_names(layer, hf_config.num_experts))
    return reader


def hf_rank_state_dict(reader, hf_config, family, manifest: Manifest, tp_rank: int, pp_rank: int, ep_rank: int) -> dict:
    """One rank's megatron state dict (local layer/expert numbering, canonical names), read from only its
    slices of the HF tensors in `reader`."""
    dtype = DTYPES[manifest.dtype]
    return {
        slot.local_name: merge_hf_to_mcore(slot, hf_config, reader, tp_rank, manifest.tp, manifest.padded_vocab_size)
        .to(slot.rule.stored_dtype(dtype)).contiguous()
        for slot in rank_slots(hf_config, family, pp_rank, manifest.pp, ep_rank, manifest.ep)
    }


def hf_rank_shard_plan(reader, hf_config, family, manifest: Manifest, tp_rank: int, pp_rank: int,
                       ep_rank: int) -> tuple[dict, dict]:
    """`hf_rank_state_dict` for writing (see `megatron_legacy.write_shard`'s `streamed`): tensors whose shard is
    HF row ranges already in the target dtype are placeholders, their bytes copied from the HF files when the
    shard is written; the others (fused HF tensors, a dtype cast) are built here, each owning its storage."""
    dtype = DTYPES[manifest.dtype]
    state_dict, streamed = {}, {}
    for slot in rank_slots(hf_config, family, pp_rank, manifest.pp, ep_rank, manifest.ep):
        pieces = shard_pieces(slot, hf_config, reader.shape, tp_rank, manifest.tp, manifest.padded_vocab_size)
        stored = slot.rule.stored_dtype(dtype)
        if pieces is None or any(reader.dtype(piece.name) != stored for piece in pieces):
            tensor = merge_hf_to_mcore(slot, hf_config, reader, tp_rank, manifest.tp,
                                       manifest.padded_vocab_size).to(stored)
            owns_storage = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
            if not (owns_storage and tensor.is_contiguous()):  # a slice of an unfused tensor
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            state_dict[slot.local_name] = tensor
            continue
        shape = [sum(piece.rows for piece in pieces), *reader.shape(pieces[0].name)[1:]]
        if pieces[0].parts > 1:
            shape[1] //= pieces[0].parts
        state_dict[slot.local_name] = torch.empty(shape, dtype=stored)
        streamed[slot.local_name] = functools.partial(_write_pieces, reader, pieces)
    return state_dict, streamed


def _write_pieces(reader, pieces, fd: int, offset: int) -> None:
    for piece in pieces:
        offset += reader.write_piece(piece, fd, offset)


def build_model_from_checkpoint(ckpt_dir: str | Path, *, implementation: str = "auto", dtype: str | None = None,
                                family_spec: str | None = None, **config_overrides):
    """This rank's GPTModel with the checkpoint's weights, at the running job's (TP, PP, EP) layout, in `dtype`
    (fp32, bf16 or fp16; default: the checkpoint's). Weights stored in another dtype are cast on load.

    `family_spec` replaces the family spec the manifest records (e.g. after its module moved)."""
    with _files_refused_in_one_line():
        manifest = Manifest.read(ckpt_dir, family_spec)
    hf_config = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(hf_config, manifest.family_spec, ckpt_dir, recorded=True)
    layout = current_layout()
    config = transformer_config(hf_config, family, tp=layout.tp, pp=layout.pp, ep=layout.ep, vpp=layout.vpp,
                                dtype=dtype or manifest.dtype, context_parallel_size=layout.cp, **config_overrides)
    model = build_rank_model(hf_config, family, config, layout, padded_vocab=manifest.padded_vocab_size,
                             implementation=implementation)
    if manifest.format == "torch_dist":
        with _files_refused_in_one_line():
            load_torch_dist(model, ckpt_dir)
    else:
        load_legacy_shard(model, ckpt_dir, manifest)
    return model, manifest, hf_config, family


def load_legacy_shard(model, ckpt_dir: str | Path, manifest: Manifest) -> None:
    layout = current_layout()
    if (manifest.tp, manifest.pp, manifest.ep) != (layout.tp, layout.pp, layout.ep):
        raise UserError(
            f"checkpoint {ckpt_dir} was written for tp={manifest.tp}, pp={manifest.pp}, ep={manifest.ep} but this job "
            f"runs tp={layout.tp}, pp={layout.pp}, ep={layout.ep}: convert again at this layout, or use "
            "--format torch_dist, which loads at any layout"
        )
    with _files_refused_in_one_line():
        iteration = megatron_legacy.checked_iteration(ckpt_dir, manifest.iteration, manifest.tp, manifest.pp,
                                                      manifest.ep)
        read = functools.cache(lambda pp_rank: megatron_legacy.read_shard(
            ckpt_dir, iteration, tp_rank=layout.tp_rank, pp_rank=pp_rank, pp=layout.pp, ep_rank=layout.ep_rank,
            ep=layout.ep))
        shard = read(layout.pp_rank) if manifest.vpp == layout.vpp else _regrouped_shard(read, manifest, layout)
    where = f"shard (tp_rank {layout.tp_rank}, pp_rank {layout.pp_rank}, ep_rank {layout.ep_rank}) of {ckpt_dir}"
    load_canonical_state_dict(model, shard, where)


def _regrouped_shard(read, manifest: Manifest, layout) -> dict:
    """This rank's tensors at its virtual pipeline stages, named as its model names them, taken from the shards of
    the same pipeline size written at another number of virtual stages: the layers a rank runs then lie in
    several of them (`read(pp_rank)` gives one)."""
    hf_config = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(hf_config, manifest.family_spec, recorded=True)
    head = head_rules(manifest.role)
    stored = {(slot.global_name, slot.is_tied_copy): (pp_rank, slot.local_name)
              for pp_rank in range(manifest.pp)
              for slot in rank_slots(hf_config, family, pp_rank, manifest.pp, layout.ep_rank, manifest.ep, head,
                                     manifest.vpp)}
    shard = {}
    for slot in rank_slots(hf_config, family, layout.pp_rank, layout.pp, layout.ep_rank, layout.ep, head, layout.vpp):
        pp_rank, name = stored[slot.global_name, slot.is_tied_copy]
        if name in read(pp_rank):
            shard[slot.local_name] = read(pp_rank)[name]
    return shard


@contextlib.contextmanager
def _files_refused_in_one_line():
    """A checkpoint's files refused by their readers (ValueError, a missing file): the user's to fix, so a
    UserError, which a training rank prints as one line instead of a traceback."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, FileNotFoundError) as err:
        raise UserError(str(err)) from None


def load_canonical_state_dict(model, state_dict: dict, where: str) -> None:
    """Load tensors named canonically (transformer-engine names) into a model built with either spec."""
    own = model.state_dict()
    wanted = canonical_names(own)
    missing = sorted(canonical for canonical in wanted.values() if canonical not in state_dict)
    unexpected = sorted(set(state_dict) - set(wanted.values()))
    if missing or unexpected:
        raise UserError(f"{where} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, canonical in wanted.items():
        given, needed = state_dict[canonical], own[name]
        if given.shape != needed.shape or not given.is_floating_point():
            raise UserError(f"tensor '{canonical}' in {where} is {given.dtype} {list(given.shape)}, the model its "
                            f"manifest describes needs a floating-point {list(needed.shape)}: the files do not "
                            "match the manifest")
    model.load_state_dict({name: state_dict[canonical] for name, canonical in wanted.items()}, strict=False)
