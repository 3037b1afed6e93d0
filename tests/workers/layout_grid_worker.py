"""torchrun worker for the layout grids: one launch runs, in turn, the role cases of tests/workers/roles_worker.py and the
SFT / preference cases of tests/workers/offline_roles_worker.py, so that each process pays megatron-core's start-up once
for both grids (tests/layout_grid.py launches it).

    layout_grid_worker ROOT CASE [CASE ...]

a CASE being `roles:DTYPE:TP,PP` (ROOT/roles/ckpt/tp{TP}pp{PP}, results in ROOT/roles/out_{DTYPE}),
`offline:MODEL:DTYPE:TP,PP,EP` (ROOT/offline/ckpt/MODEL/tp{TP}pp{PP}ep{EP}, results in ROOT/offline/out),
`update_passes` (tests/workers/update_passes_worker.py on the role grid's checkpoints, into ROOT/passes) or
`state_save:TP,PP` (tests/workers/training_state_worker.py's save phase on them, into ROOT/state), `lora:MODEL:TP,PP,EP`
or `lora:MODEL:TP,PP,EP:bf16` (a LoRA actor and critic update, in fp32 or bf16, on the role grid's qwen2
checkpoint or the offline grid's MODEL, into ROOT/lora), `lora_layers` (adapted linears at TP 2, into
ROOT/lora) or `lora_jobs` (the SFT and DPO jobs with LoRA on 2 ranks, into ROOT/lora/jobs; all three
tests/workers/lora_worker.py). A case that raises stops the launch with an error naming that case.
"""
from __future__ import annotations

import sys
from pathlib import Path

from verl_mega.parallel.process_exit import exit_process

import tests.workers.lora_worker as lora_worker
import tests.workers.offline_roles_worker as offline_roles_worker
import tests.workers.roles_worker as roles_worker
import tests.workers.training_state_worker as training_state_worker
import tests.workers.update_passes_worker as update_passes_worker


def run_case(root: Path, case: str) -> None:
    kind, *spec = case.split(":")
    if kind == "roles":
        dtype, sizes = spec
        tp, pp = (int(size) for size in sizes.split(","))
        roles = root / "roles"
        roles_worker.run_layout(roles / "ckpt", roles / "hf", roles / f"out_{dtype}", dtype, tp, pp)
    elif kind == "offline":
        offline = root / "offline"
        offline_roles_worker.run_named_case(offline / "ckpt", offline / "out", ":".join(spec))
    elif kind == "update_passes":
        update_passes_worker.run_passes(root / "roles" / "ckpt", root / "roles" / "hf", root / "passes")
    elif kind == "state_save":
        (sizes,) = spec
        tp, pp = (int(size) for size in sizes.split(","))
        training_state_worker.save_phase(root / "roles" / "ckpt", root / "state", tp, pp)
    elif kind == "lora":
        model, sizes, *dtype = spec
        tp, pp, ep = (int(size) for size in sizes.split(","))
        # The dense model is the role grid's, the others the offline grid's (tests/layout_grid.py converts both).
        ckpt = (root / "roles" / "ckpt" / f"tp{tp}pp{pp}" if model == "qwen2"
                else root / "offline" / "ckpt" / model / f"tp{tp}pp{pp}ep{ep}")
        lora_worker.run_update(ckpt, root / "lora", model, tp, pp, ep, *dtype)
    elif kind == "lora_layers":
        lora_worker.run_layers(root / "lora")
    elif kind == "lora_jobs":
        (root / "lora" / "jobs").mkdir(exist_ok=True)
        lora_worker.run_jobs(root / "roles", root / "lora" / "jobs")
    else:
        raise ValueError(f"unknown case kind {kind!r} in {case!r}: roles, offline, update_passes, state_save, lora, "
                         "lora_layers or lora_jobs")


def main(argv: list[str]) -> None:
    from verl_mega.parallel.state import destroy_parallel

    root, *cases = argv
    for case in cases:
        try:
            run_case(Path(root), case)
        except Exception as error:
            raise RuntimeError(f"layout grid case {case} failed: {error}") from error
    destroy_parallel()


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
