"""A checkpoint written by old code resumes on the checked-out code, bit for bit.

tests/fixtures/rl_resume_dfd1f32/ holds RL run folders written by commit dfd1f32 (GRPO with an adaptive KL
coefficient in the reward and reward normalisation; rollout.mode sync and one_step_off, the latter with a round
generated ahead in its checkpoint): killed during step 4, with a checkpoint of step 2, and the steps 3 and 4 that
the same run logged straight through. A copy of each, in a folder whose name has a space and a '#', is resumed
here through the command line's entry point only. Could fail if the code stopped reading the old
trainer_state.json (sampler, KL controller, reward normaliser, rollout schedule and its buffer), the old actor
and optimizer state or RNG file, or the old config.yaml, or read one of them into another value.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_runs import NOT_COMPARED

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "rl_resume_dfd1f32"
MODES = {"sync": (), "one_step_off": ("rollout.mode=one_step_off",)}
SAVED_STEP = 2
# Metrics whose formula changed after dfd1f32 in summation order only, compared to fp64 rounding: f689139 computes
# the rollout correction's log-perplexity difference as verl does (each policy's per response, then the difference)
# where dfd1f32 took the per-response mean of the token log-ratio.
REORDERED = ("rollout_corr/log_ppl_diff",)


def train(root: Path, run_dir: Path | str, overrides) -> subprocess.CompletedProcess:
    """The fixture's job.yaml run in `root` (its paths are relative to it) in a process of its own."""
    command = [sys.executable, "-m", "verl_mega.trainer.main", "--config", "job.yaml", f"trainer.run_dir={run_dir}",
               *overrides]
    # PYTHONPATH: the fixture's reward module, for the trainer and any worker process it starts.
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def compared(path: Path) -> dict[int, dict]:
    """step -> its record in the JSON lines at `path`, wall-clock figures left out."""
    return {record["step"]: {k: v for k, v in record.items() if not k.startswith(NOT_COMPARED)}
            for record in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_of_old_code_resumes_to_its_metrics_and_an_uninterrupted_run_s(tmp_path, mode):
    root = tmp_path / "fixture copy #1"
    shutil.copytree(FIXTURE, root)
    run_dir = root / mode
    resumed = train(root, run_dir, MODES[mode])
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{SAVED_STEP:06d}'} at step {SAVED_STEP}" in resumed.stdout
    got = compared(run_dir / "metrics.jsonl")
    expected = compared(run_dir / "expected_metrics.jsonl")
    assert sorted(got) == [1, 2, 3, 4] and sorted(expected) == [3, 4]
    # The old code's own continuation, in every metric it logged (newer code may log more).
    assert {step: {key: got[step].get(key) for key in expected[step]} for step in expected} == {
        step: {key: pytest.approx(value, rel=1e-9, abs=0) if key.startswith(REORDERED) else value
               for key, value in record.items()} for step, record in expected.items()}
    train(root, "straight", MODES[mode])
    straight = compared(root / "straight" / "metrics.jsonl")
    # Today's code straight through: the resumed steps whole; the old code's steps in what it logged.
    assert {step: straight[step] for step in expected} == {step: got[step] for step in expected}
    assert {step: {key: straight[step].get(key) for key in got[step]} for step in (1, 2)} == {1: got[1], 2: got[2]}
