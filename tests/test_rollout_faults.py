"""Faults of a disaggregated run: a rank of either role killed mid-run stops the other."""
import os
import signal
import subprocess
import time

import psutil
import pytest

from trainer_runs import make_inputs, train_command

STEPS = 50  # far more than the run lives through
# Async partial rollouts on a rollout rank of their own: the training rank talks to it from its main thread (the
# step's chunks) and from its waiting thread (the next step's, during the update); a death is seen in either.
DISAGGREGATED_PARTIAL = ("parallel.tp=1", "parallel.pp=1", "parallel.rollout_ranks=1", "rollout.mode=async",
                         "rollout.max_staleness=1", "rollout.partial=finish", "rollout.partial_chunk_tokens=1",
                         f"trainer.total_steps={STEPS}", "trainer.save_every=0")


@pytest.mark.slow
def test_a_rollout_rank_killed_mid_run_stops_the_training_rank_with_one_line_naming_it(tmp_path):
    """SIGKILL the rollout rank once step 1 is logged: the training rank must stop (not hang, not train on) with
    `verl-mega train: error: rollout rank 1 (pid P on HOST) did not answer ...` on one line, P the killed one.
    Could fail if the waiting thread swallowed the bridge's error, or a traceback replaced the line."""
    victim, survivor, returncode, stderr, steps = kill_after_first_step(tmp_path, 1)
    assert returncode != 0 and not survivor.is_running() and steps < STEPS
    errors = [line for line in stderr.splitlines() if line.startswith("verl-mega train: error: ")]
    assert any(line.startswith(f"verl-mega train: error: rollout rank 1 (pid {victim.pid} on ")
               and "did not answer within" in line for line in errors), stderr[-3000:]


@pytest.mark.slow
def test_a_training_rank_killed_mid_run_stops_the_rollout_rank(tmp_path):
    """SIGKILL the training rank once step 1 is logged: the rollout rank must not outlive it (torchrun's agent
    stops it, or its next receive fails), and the launch fails naming rank 0 as the root cause."""
    victim, survivor, returncode, stderr, _ = kill_after_first_step(tmp_path, 0)
    assert returncode != 0 and not survivor.is_running()
    root_cause = stderr[stderr.index("Root Cause"):]
    assert "rank      : 0" in root_cause and f"pid: {victim.pid}" in root_cause, stderr[-3000:]


def kill_after_first_step(tmp_path, rank: int):
    """Launch the run, SIGKILL global `rank` once step 1 is logged, wait for the launch to end: (the killed
    process, the other rank's, the launch's exit code, its stderr, the steps logged)."""
    run_dir = tmp_path / "run"
    process = subprocess.Popen(train_command(make_inputs(tmp_path), run_dir, 2, *DISAGGREGATED_PARTIAL),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert process.poll() is None and time.time() < deadline, "the run ended before its first step"
            time.sleep(0.05)
        victim, survivor = rank_process(process.pid, rank), rank_process(process.pid, 1 - rank)
        victim.kill()
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return victim, survivor, process.returncode, stderr, len(metrics.read_text().splitlines())


def rank_process(launcher_pid: int, rank: int) -> psutil.Process:
    """The launched trainer process of global `rank` (torchrun's agent set RANK in its environment)."""
    for child in psutil.Process(launcher_pid).children(recursive=True):
        if "verl_mega.trainer.main" in " ".join(child.cmdline()) and child.environ().get("RANK") == str(rank):
            return child
    raise AssertionError(f"no trainer process of rank {rank} under pid {launcher_pid}")
