"""The layout grids' shared launches: tests/test_layout_invariance.py (actor, reference and critic, fp32 and bf16)
and tests/test_offline_layout_invariance.py (SFT and DPO updates) compare results computed at several (TP, PP, DP)
layouts. A layout's world size fixes its launch, so both grids ride on the same three torchrun launches (1, 2
and 8 processes) of tests/workers/layout_grid_worker.py, each process running every case of its world size in turn:
three start-ups of megatron-core per session instead of nine. Two other files' worker runs on the role grid's
model and checkpoints ride along (SHARED_CASES). Each test reads its cases from the folder.
"""
from __future__ import annotations

import os
from pathlib import Path

from verl_mega.parallel.spawn import run_torchrun

DENSE, MOE, QWEN3_MOE, MLA = "qwen2", "mixtral", "qwen3_moe", "deepseek_v3"
# processes -> (TP, PP) layouts of the role grid, run in each of ROLE_DTYPES; DP = processes / (TP·PP).
ROLE_LAUNCHES = {1: ["1,1"], 2: ["2,1", "1,2", "1,1"], 8: ["2,2"]}
ROLE_DTYPES = ("fp32", "bf16")
# processes -> the offline grid's cases (MODEL:DTYPE:TP,PP,EP[:replay], see tests/workers/offline_roles_worker.py).
OFFLINE_LAUNCHES = {
    1: [f"{DENSE}:fp32:1,1,1", f"{MOE}:fp32:1,1,1", f"{DENSE}:bf16:1,1,1", f"{MOE}:fp32:1,1,1:replay",
        f"{QWEN3_MOE}:fp32:1,1,1", f"{MLA}:fp32:1,1,1"],
    2: [f"{DENSE}:fp32:2,1,1", f"{DENSE}:fp32:1,2,1", f"{DENSE}:fp32:1,1,1", f"{MOE}:fp32:1,1,2",
        f"{DENSE}:bf16:2,1,1", f"{MOE}:fp32:2,1,1:replay", f"{MOE}:fp32:1,2,1:replay", f"{MOE}:fp32:1,1,2:replay",
        f"{MLA}:fp32:1,1,2"],
    8: [f"{DENSE}:fp32:2,2,1", f"{QWEN3_MOE}:fp32:1,2,2"],
}


# processes -> other test files' cases on the role grid's checkpoints: tests/workers/update_passes_worker.py's updates
# (into ROOT/passes) and tests/workers/training_state_worker.py's save at (TP, PP) = (2, 2) (into ROOT/state; its
# resume phase needs fresh processes, so tests/test_training_state.py launches it).
# processes -> tests/workers/lora_worker.py's updates (MODEL:TP,PP,EP[:bf16], into ROOT/lora): a LoRA actor and critic at
# every role-grid layout on its checkpoints, in bf16 at TP 1 and TP 2, and on the offline grid's MoE model at EP 1
# and 2 (its experts' adapters).
LORA_LAUNCHES = {1: [f"{DENSE}:1,1,1", f"{MOE}:1,1,1", f"{DENSE}:1,1,1:bf16"],
                 2: [f"{DENSE}:2,1,1", f"{DENSE}:1,2,1", f"{DENSE}:1,1,1", f"{MOE}:1,1,2", f"{DENSE}:2,1,1:bf16"],
                 8: [f"{DENSE}:2,2,1"]}
# ...and the adapted linears at TP 2 (lora_layers), and the SFT and DPO jobs with LoRA on 2 ranks (lora_jobs).
SHARED_CASES = {2: ["update_passes", "lora_layers", "lora_jobs"], 8: ["state_save:2,2"]}


def launch_cases(nproc: int) -> list[str]:
    """The worker's cases for the launch of `nproc` processes: the role grid (fp32 first, as it ran alone), the
    offline grid, the LoRA updates at the role grid's layouts, then SHARED_CASES."""
    roles = [f"roles:{dtype}:{layout}" for dtype in ROLE_DTYPES for layout in ROLE_LAUNCHES.get(nproc, [])]
    lora = [f"lora:{case}" for case in LORA_LAUNCHES.get(nproc, [])]
    return (roles + [f"offline:{case}" for case in OFFLINE_LAUNCHES.get(nproc, [])] + lora
            + SHARED_CASES.get(nproc, []))


def convert_inputs(root: Path) -> None:
    """The tiny models and every layout's converted checkpoint that the cases load."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    roles = root / "roles"
    hf_dir = make_tiny_hf_model(roles / "hf", DENSE, num_hidden_layers=2)
    for tp, pp in {tuple(map(int, layout.split(","))) for layouts in ROLE_LAUNCHES.values() for layout in layouts}:
        convert_hf_to_mcore(hf_dir, roles / "ckpt" / f"tp{tp}pp{pp}", tp=tp, pp=pp)
    offline = root / "offline"
    for model in (DENSE, MOE, QWEN3_MOE, MLA):
        hf_dir = make_tiny_hf_model(offline / "hf" / model, model, num_hidden_layers=2)
        for case in (case for cases in OFFLINE_LAUNCHES.values() for case in cases if case.startswith(f"{model}:")):
            tp, pp, ep = (int(size) for size in case.split(":")[2].split(","))
            target = offline / "ckpt" / model / f"tp{tp}pp{pp}ep{ep}"
            if not target.exists():
                convert_hf_to_mcore(hf_dir, target, tp=tp, pp=pp, ep=ep)


def run_layout_grid(root: Path) -> Path:
    """Converts the inputs under `root`, runs the three launches and returns `root` (see layout_grid_worker)."""
    convert_inputs(root)
    for folder in [*(f"roles/out_{dtype}" for dtype in ROLE_DTYPES), "offline/out", "passes", "state", "lora"]:
        (root / folder).mkdir()
    tests_dir = str(Path(__file__).parent)
    # The workers live next to this file; the rest of PYTHONPATH keeps this checkout's verl_mega first.
    env = {"PYTHONPATH": ":".join(filter(None, [tests_dir, str(Path(tests_dir).parent),
                                                      *os.environ.get("PYTHONPATH", "").split(":")]))}
    for nproc in sorted({*ROLE_LAUNCHES, *OFFLINE_LAUNCHES, *SHARED_CASES}):
        run_torchrun(nproc, "tests.workers.layout_grid_worker", [str(root), *launch_cases(nproc)], env=env)
    return root
