"""Checkpoint and resume of the PPO trainer: exact after SIGKILL, at another layout, refusals."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from verl_mega.parallel.launch import free_port
from verl_mega.checkpoint import run_checkpoints

NOT_COMPARED = ("timing/", "perf/")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("resume")
    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    data = write_rows(make_task_rows("copy", 64, seed=0, max_digits=2), root / "copy.jsonl")
    return root, hf, data


def train_command(setup, run_dir, nproc, *overrides):
    from verl_mega.demo import EXAMPLES

    root, hf, data = setup
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(free_port()), "-m", "verl_mega.trainer.main", "--config", str(EXAMPLES / "ppo_gae_demo.yaml"),
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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sigkill_at_a_random_step_then_resume_gives_the_same_metrics(setup, tmp_path, dtype):
    layout = ["parallel.tp=2", "parallel.pp=1", "trainer.total_steps=6", f"model.dtype={dtype}"]
    run(train_command(setup, tmp_path / "straight", 4, *layout))
    expected = records(tmp_path / "straight")
    assert sorted(expected) == list(range(1, 7))

    kill_after = random.randint(3, 5)
    print(f"killing after step {kill_after}")
    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen(train_command(setup, interrupted, 4, *layout), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = interrupted / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= kill_after):
        assert process.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert len(run_checkpoints.complete_checkpoints(interrupted)) >= 1

    resumed = run(train_command(setup, interrupted, 4, *layout))
    assert "resumed from" in resumed.stdout
    assert records(interrupted) == expected


@pytest.mark.slow
def test_resume_at_another_layout_and_partial_saves_are_ignored(setup, tmp_path):
    run_dir = tmp_path / "run"
    eight_prompts = ["data.batch_size=8", "actor.mini_batch_size=8", "critic.mini_batch_size=8"]
    run(train_command(setup, run_dir, 8, "parallel.tp=2", "parallel.pp=2", "trainer.total_steps=2", *eight_prompts))
    assert [p.name for p in run_checkpoints.complete_checkpoints(run_dir)] == ["step_000002"]
    # A save killed half-way leaves only a temp folder behind.
    partial = run_dir / "checkpoints" / ".step_000004.tmp"
    (partial / "actor").mkdir(parents=True)
    result = run(train_command(setup, run_dir, 4, "parallel.tp=2", "parallel.pp=1", "trainer.total_steps=3",
                               *eight_prompts))
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000002'} at step 2" in result.stdout
    steps = sorted(records(run_dir))
    assert steps == [1, 2, 3]
    assert (run_dir / "final_actor" / "verl_mega_manifest.json").is_file()


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(setup, tmp_path):
    from verl_mega.models.tiny import make_tiny_hf_model

    root, _, _ = setup
    run_dir = tmp_path / "run"
    run(train_command(setup, run_dir, 1, "parallel.tp=1", "parallel.pp=1", "trainer.total_steps=2"))
    other = make_tiny_hf_model(tmp_path / "other", "qwen2", vocab_size=64, num_hidden_layers=2, hidden_size=32,
                               intermediate_size=64)
    command = train_command(setup, run_dir, 1, "parallel.tp=1", "parallel.pp=1", "trainer.total_steps=3",
                            f"model.hf_path={other}")
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode != 0
    assert "was written for another model" in result.stderr


def test_only_complete_checkpoints_are_listed(tmp_path):
    for name in ("step_000002", "step_000010", ".step_000012.tmp", "step_x"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert [p.name for p in run_checkpoints.complete_checkpoints(tmp_path)] == ["step_000002", "step_000010"]
