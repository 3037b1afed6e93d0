"""Writing megatron `dist_checkpointing` ("torch_dist") checkpoints of an HF model, loadable at any layout.

Writing needs megatron's own sharded state dict, so it runs under torchrun at the target layout: each rank
streams its shard from the HF files into its model and saves. (Reading: `verl_mega.checkpoint.torch_dist`.)
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from verl_mega.checkpoint.manifest import Manifest
from verl_mega.checkpoint.model_io import hf_rank_state_dict, load_canonical_state_dict, open_hf_checkpoint
from verl_mega.checkpoint.torch_dist import DIST_DIR
from verl_mega.models import HFModelConfig, family_for
from verl_mega.models.builder import build_gpt_model, transformer_config
from verl_mega.parallel.spawn import run_torchrun
from verl_mega.parallel.state import destroy_parallel, init_parallel


def write_torch_dist(root: Path, hf_dir: str | Path, manifest: Manifest) -> None:
    """Save a dist checkpoint of the HF model at `manifest`'s layout into root/iter_0000000."""
    manifest.write(root)  # the workers read the layout and the config from it
    run_torchrun(manifest.tp * manifest.pp * manifest.ep, "verl_mega.converters.torch_dist",
                 ["--hf", str(hf_dir), "--out", str(root)])


def _write_rank(hf_dir: Path, root: Path) -> None:
    from megatron.core import dist_checkpointing

    manifest = Manifest.read(root)
    hf_config = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(hf_config, manifest.family_spec, root, recorded=True)
    layout = init_parallel(manifest.tp, manifest.pp, manifest.ep)
    config = transformer_config(hf_config, family, tp=layout.tp, pp=layout.pp, ep=layout.ep, dtype=manifest.dtype)
    model = build_gpt_model(hf_config, family, config, padded_vocab=manifest.padded_vocab_size,
                            pre_process=layout.is_first_stage, post_process=layout.is_last_stage)
    reader = open_hf_checkpoint(hf_dir, hf_config, family)
    state_dict = hf_rank_state_dict(reader, hf_config, family, manifest, layout.tp_rank, layout.pp_rank, layout.ep_rank)
    load_canonical_state_dict(model, state_dict, f"the converted shard of rank {layout.rank}")
    out = root / DIST_DIR
    out.mkdir(exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out))
    torch.distributed.barrier()
    destroy_parallel()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="verl_mega.converters.torch_dist")
    parser.add_argument("--hf", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    _write_rank(Path(args.hf), Path(args.out))


if __name__ == "__main__":
    main()
