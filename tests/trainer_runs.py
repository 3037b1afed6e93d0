"""Trainer runs of the tiny Qwen2 on the copy task, as the resume and mixed-precision tests start them (torchrun
subprocesses of `verl_mega.trainer.main`), and the bf16 run at another layout that both share (conftest's
`bf16_layout_runs`): one run checks what each file asserts about it instead of two runs of the same shape.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from verl_mega.parallel.spawn import free_port
from verl_mega.run import checkpoints as run_checkpoints

NOT_COMPARED = ("timing/", "perf/", "val/seconds")  # wall-clock figures
# PPO's roles are a superset of GRPO's (a critic too); GRPO's bf16 run is tests/test_resume.py's SIGKILL case.
RUNS = {"ppo_gae": "ppo_gae_demo.yaml"}
# A save killed half-way leaves only its temp folder, with whatever the ranks had written; this one is planted
# before the resume, which must neither resume from it nor publish its content.
PARTIAL_SAVE, PLANTED = ".step_000004.tmp", "actor/planted-by-a-killed-save"


def make_inputs(root: Path) -> tuple[Path, Path, Path]:
    """(root, HF folder of a tiny Qwen2, copy-task rows) under `root`."""
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.models.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    data = write_rows(make_task_rows("copy", 64, seed=0, max_digits=2), root / "copy.jsonl")
    return root, hf, data


def train_command(setup, run_dir, nproc, *overrides, example: str = "ppo_gae_demo.yaml"):
    from verl_mega.demo import EXAMPLES

    root, hf, data = setup
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(free_port()), "-m", "verl_mega.trainer.main", "--config", str(EXAMPLES / example),
            f"model.hf_path={hf}", f"data.train_files=[{data}]", f"trainer.run_dir={run_dir}",
            "data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "critic.mini_batch_size=4",
            "actor.micro_batch_size=2", "critic.micro_batch_size=2", "trainer.save_every=2", *overrides]


def run(command):
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def records(run_dir):
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)}
            for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def bf16_layout_change_run(setup, folder: Path, algorithm: str) -> None:
    """A bf16 run of `algorithm` (RUNS) in `folder`/run at (TP, PP, DP) = (2, 2, 2) for 2 steps (a save at step 2),
    then, beside a planted partial save of step 4, resumed at (2, 1, 2) to step 4. What the tests check between the
    two runs is recorded in `folder`/record.json (layout_change_record reads it): the complete checkpoints, the
    saved actor's tensor dtypes and the resumed run's output."""
    from megatron.core import dist_checkpointing

    run_dir = folder / "run"
    common = ["model.dtype=bf16", "data.batch_size=8", "actor.mini_batch_size=8", "critic.mini_batch_size=8"]
    run(train_command(setup, run_dir, 8, "parallel.tp=2", "parallel.pp=2", "trainer.total_steps=2", *common,
                      example=RUNS[algorithm]))
    first = run_checkpoints.complete_checkpoints(run_dir)
    stored = dist_checkpointing.load_tensors_metadata(str(first[-1] / "actor")) if first else {}
    planted = run_dir / "checkpoints" / PARTIAL_SAVE / PLANTED
    planted.parent.mkdir(parents=True)
    planted.write_text("")
    resumed = run(train_command(setup, run_dir, 4, "parallel.tp=2", "parallel.pp=1", "trainer.total_steps=4",
                                *common, example=RUNS[algorithm]))
    (folder / "record.json").write_text(json.dumps({
        "first_checkpoints": [str(path) for path in first],
        "stored_dtypes": {name: str(meta.dtype) for name, meta in stored.items()},
        "resumed_stdout": resumed.stdout}))


def layout_change_record(folder: Path) -> dict:
    """bf16_layout_change_run's record of `folder`, with its run folder and paths as Paths and dtypes as torch's."""
    import torch

    record = json.loads((folder / "record.json").read_text())
    return {"run_dir": folder / "run", "first_checkpoints": [Path(path) for path in record["first_checkpoints"]],
            "stored_dtypes": {name: getattr(torch, dtype.removeprefix("torch."))
                              for name, dtype in record["stored_dtypes"].items()},
            "resumed_stdout": record["resumed_stdout"]}
