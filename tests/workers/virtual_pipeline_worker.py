"""torchrun worker (2 processes, PP 2) for tests/test_virtual_pipeline.py: each case's roles at vpp 1 and 2 on the
same batch, from the same legacy checkpoint converted at PP 2: forward-only outputs, and one forward-backward's loss
and gradients.

Run as `virtual_pipeline_worker ROOT CASE [CASE ...]`; a case is `MODEL` (the actor and the critic of
ROOT/ckpt/MODEL) or `MODEL:replay` (an MoE actor replaying routes given for every token). Each rank saves
ROOT/out/{MODEL[_replay]}_{ROLE}_vpp{V}_rank{R}.pt: {'outputs', 'loss', 'grads'}, the gradients of this rank's
tensors by global megatron name (the two layouts spread the layers differently over the ranks: the test joins the
ranks').
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from tests.workers.sequence_parallel_worker import case_roles, role_pass, save_case
from verl_mega.parallel.process_exit import exit_process


def by_global_name(grads: dict, ckpt: Path, role: str) -> dict:
    """`grads` (DDP's parameter names) keyed by the global megatron names of `sharding.rank_slots`."""
    from verl_mega.checkpoint.manifest import Manifest
    from verl_mega.checkpoint.roles import head_rules
    from verl_mega.models import HFModelConfig, family_for
    from verl_mega.models.sharding import rank_slots
    from verl_mega.models.spec import canonical_names
    from verl_mega.parallel.state import current_layout

    manifest, layout = Manifest.read(ckpt), current_layout()
    hf_config = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(hf_config, manifest.family_spec, recorded=True)
    slots = {slot.local_name: slot for slot in rank_slots(hf_config, family, layout.pp_rank, layout.pp,
                                                          head_rules=head_rules(role), vpp=layout.vpp)}
    local = {name.removeprefix("module."): grad for name, grad in grads.items()}
    named = {}
    for name, canonical in canonical_names(local).items():
        slot = slots[canonical]
        named[slot.global_name + (" (tied copy)" if slot.is_tied_copy else "")] = local[name]
    return named


def main(argv: list[str]) -> None:
    from verl_mega.parallel.state import destroy_parallel, init_parallel

    root, *cases = argv
    for vpp in (1, 2):
        layout = init_parallel(1, 2, vpp=vpp)
        for case in cases:
            model, replay, roles = case_roles(case)
            ckpt = Path(root) / "ckpt" / model
            for role in roles:
                result = role_pass(role, ckpt, replay=replay, train=True)
                result["grads"] = by_global_name(result["grads"], ckpt, role)
                save_case(root, case, role, f"vpp{vpp}", layout.rank, result)
        dist.barrier()
    destroy_parallel()


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
