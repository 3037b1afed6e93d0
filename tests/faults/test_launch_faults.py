"""Faults at launch: Slurm time limits read as Slurm reads them, the run's config checked before anything is
submitted or started, a failed sbatch leaves nothing behind, a failed rank's exit code and message come out of
`launch local`, and ranks die with a killed launcher."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_mega.launch import local, slurm

from .processes import alive, survivors_after

REPO = Path(__file__).resolve().parents[2]
SLURM_CPU_NODE = ["--nodes", "1", "--gpus-per-node", "0"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("launch_faults")
    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    data = write_rows(make_task_rows("copy", 8, seed=0, max_digits=2), root / "copy.jsonl")
    config = root / "ppo.yaml"
    config.write_text(f"model: {{hf_path: {hf}}}\ndata: {{train_files: [{data}], batch_size: 4}}\n"
                      "actor: {mini_batch_size: 4}\ncritic: {mini_batch_size: 4}\n")
    return {"config": config, "root": root}


def refused(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# --- Slurm time limits ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, seconds", [
    ("0", None), ("UNLIMITED", None), ("infinite", None), ("Unlimited", None), ("90", 5400), ("10:30", 630),
    ("1:00:00", 3600), ("1-2", 93600), ("1-2:30", 95400), ("1-2:30:15", 95415), ("00:00:10", 10),
])
def test_slurm_time_forms_slurm_accepts(value, seconds):
    assert slurm.slurm_time_seconds(value) == seconds


@pytest.mark.parametrize("value", ["-10", "1-2:3:4:5", "1:2:3:4", "abc", "", "1-", ":5", "10:-5", "1.5", "2h",
                                   "1--2", "0-"])
def test_slurm_time_forms_slurm_refuses_write_nothing(capsys, tmp_path, value):
    run_dir = tmp_path / "run"
    err = refused(capsys, slurm.main, [*SLURM_CPU_NODE, "--time", value, "--run-dir", str(run_dir),
                                       "--module", "verl_mega.converters.verify"])
    assert f"--time {value!r} is not a Slurm time limit" in err
    assert not run_dir.exists()


def test_an_unlimited_job_keeps_its_warning_signal(capsys, tmp_path):
    assert slurm.main([*SLURM_CPU_NODE, "--time", "UNLIMITED", "--run-dir", str(tmp_path / "run"), "--dry-run",
                       "--module", "verl_mega.converters.verify"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --time=UNLIMITED\n" in script and "#SBATCH --signal=B:USR1@300\n" in script


# --- the run's config, checked before submitting or starting ------------------------------------------------

@pytest.mark.parametrize("overrides, words", [
    (["rollout.n=0"], "rollout.n must be >= 1, got 0"),
    (["trainer.total_steps=-1"], "trainer.total_steps must be >= 1"),
    (["parallel.tp=2"], "parallel.tp * parallel.pp = 2 must divide the number of processes (1)"),
    (["data.train_files=[/nonexistent.jsonl]"], "data file not found: /nonexistent.jsonl"),
    (["no_such.key=1"], "config key 'no_such'"),
])
@pytest.mark.parametrize("launcher", ["slurm", "slurm --dry-run", "local"])
def test_a_bad_run_config_is_refused_before_anything_starts(capsys, tmp_path, monkeypatch, inputs, overrides, words,
                                                            launcher):
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # neither sbatch nor torchrun could be reached by mistake
    run_dir = tmp_path / "run"
    before = inputs["config"].read_text()
    if launcher.startswith("slurm"):
        dry_run = ["--dry-run"] if launcher.endswith("--dry-run") else []
        argv = [*SLURM_CPU_NODE, *dry_run, "--run-dir", str(run_dir), str(inputs["config"]), *overrides]
        err = refused(capsys, slurm.main, argv)
    else:
        err = refused(capsys, local.main, ["--nproc", "1", str(inputs["config"]), *overrides])
    assert words in err
    assert not run_dir.exists() and inputs["config"].read_text() == before


FAKE_SBATCH = "#!/bin/sh\necho 'sbatch: error: invalid partition specified: gpu' >&2\nexit 1\n"


@pytest.mark.parametrize("existing", [False, True], ids=["new_run_dir", "existing_run_dir"])
@pytest.mark.parametrize("sbatch", [FAKE_SBATCH, None], ids=["sbatch_fails", "no_sbatch"])
def test_a_failed_submission_leaves_nothing_behind(capsys, tmp_path, monkeypatch, inputs, existing, sbatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if sbatch:
        (bin_dir / "sbatch").write_text(sbatch)
        (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    run_dir = tmp_path / "run"
    if existing:
        run_dir.mkdir()
        (run_dir / "notes.txt").write_text("mine")
    code = slurm.main([*SLURM_CPU_NODE, "--run-dir", str(run_dir), str(inputs["config"])])
    err = capsys.readouterr().err
    assert code == 2
    assert ("invalid partition specified" if sbatch else "sbatch not found on PATH") in err
    assert "nothing was submitted" in err
    if existing:
        assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    else:
        assert not run_dir.exists()


# --- launch local: the rank's own exit code and message; ranks die with the launcher -------------------------

@pytest.mark.slow
@pytest.mark.parametrize("code", [2, 3])
def test_launch_local_forwards_the_ranks_exit_code_and_message(tmp_path, code):
    result = subprocess.run(
        [sys.executable, "-m", "verl_mega.cli", "launch", "local", "--nproc", "2", "--env", f"PYTHONPATH={REPO}",
         "--module", "tests.faults.rank_payloads", "--", "fail", str(code)],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == code, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rank ") and f"failed (exit {code}): payload: error: told to fail with {code}" in last
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


@pytest.mark.slow
def test_ranks_exit_when_the_launcher_is_sigkilled(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "verl_mega.cli", "launch", "local", "--nproc", "2", "--env", f"PYTHONPATH={REPO}",
         "--module", "tests.faults.rank_payloads", "--", "wait", str(tmp_path)],
        cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    pid_files = [tmp_path / f"rank{rank}.pid" for rank in range(2)]
    deadline = time.time() + 120
    while not all(p.is_file() for p in pid_files):
        assert launcher.poll() is None and time.time() < deadline, "the ranks did not start"
        time.sleep(0.1)
    ranks = [json.loads(p.read_text())["pid"] for p in pid_files]
    assert all(alive(pid) for pid in ranks)
    os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's group: launcher and torchrun agent, not the ranks
    launcher.wait()
    survivors = survivors_after(ranks, seconds=10)
    for pid in survivors:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"ranks {survivors} outlived their launcher"
