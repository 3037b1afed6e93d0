"""The sbatch script `verl-mega launch slurm` writes: directives, srun/torchrun line, input checks.

No Slurm needed; the batch script's signal forwarding is exercised with stand-in srun/scontrol.
"""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from verl_mega.launch import slurm
from verl_mega.launch.payload import TRAINER_MODULE


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """A run config the pre-flight check accepts (a dry run checks what a submission checks), for RL and SFT."""
    from verl_mega.data.tables import write_rows
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("launch_render")
    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    data = write_rows([{"prompt": f"copy: {i}", "response": str(i)} for i in range(8)], root / "rows.jsonl")
    path = root / "ppo.yaml"
    path.write_text(f"model: {{hf_path: {hf}}}\ndata: {{train_files: [{data}], batch_size: 32}}\n"
                    "actor: {mini_batch_size: 32, micro_batch_size: 1}\ncritic: {mini_batch_size: 32, micro_batch_size: 1}\n")
    return path


def dry_run(capsys, run_dir, *argv):
    assert slurm.main(["--run-dir", str(run_dir), "--dry-run", *argv]) == 0
    printed = capsys.readouterr().out
    assert printed == (run_dir / "sbatch.sh").read_text()
    return printed


def test_trainer_on_gpu_nodes(capsys, tmp_path, config):
    script = dry_run(capsys, tmp_path / "run", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
                     "--time", "04:00:00", "--account", "proj", "--qos", "high", "--signal-seconds", "600",
                     str(config), "trainer.total_steps=10", "actor.optim.lr=1e-6")
    assert "#SBATCH --nodes=4\n" in script
    assert "#SBATCH --ntasks-per-node=1\n" in script
    assert "#SBATCH --gpus-per-node=8\n" in script
    for line in ("--partition=gpu", "--time=04:00:00", "--account=proj", "--qos=high", "--requeue",
                 "--signal=B:USR1@600", f"--output={tmp_path}/run/slurm-%j.out", "--job-name=verl-mega-ppo"):
        assert f"#SBATCH {line}\n" in script
    assert "--dependency" not in script and "--cpus-per-task" not in script
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert '--nnodes="$SLURM_NNODES" --nproc-per-node=8' in script
    assert '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID.$restart"' in script
    assert f"-m {TRAINER_MODULE} --config {config} trainer.total_steps=10 actor.optim.lr=1e-6 &" in script
    assert "container" not in script
    subprocess.run(["bash", "-n", str(tmp_path / "run" / "sbatch.sh")], check=True)


def test_cpu_nodes_other_module_container_env(capsys, tmp_path):
    script = dry_run(capsys, tmp_path / "run", "--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "4",
                     "--container-image", "nvcr.io/nvidia/pytorch:24.05-py3", "--mounts", "/data:/data",
                     "--env", "NCCL_SOCKET_IFNAME=ib0", "--env", "NOTE=two words", "--singleton",
                     "--module", "verl_mega.converters.verify", "--", "--hf", "X", "--ckpt", "Y Z")
    assert "#SBATCH --gpus-per-node" not in script
    assert "--nproc-per-node=4" in script
    assert "srun_args+=(--container-image=nvcr.io/nvidia/pytorch:24.05-py3)\n" in script
    assert "srun_args+=(--container-mounts=/data:/data)\n" in script
    assert "export NCCL_SOCKET_IFNAME=ib0\nexport NOTE='two words'\n" in script
    assert "#SBATCH --dependency=singleton\n" in script
    assert "#SBATCH --job-name=verl-mega-verify\n" in script
    assert " python -m torch.distributed.run" in script  # the image's python, not this machine's path
    assert "-m verl_mega.converters.verify --hf X --ckpt 'Y Z' &" in script


CPU_NODE = ["--nodes", "1", "--gpus-per-node", "0"]
SOME_MODULE = ["--module", "verl_mega.converters.verify"]


def test_job_option_sets_the_trainers_job(capsys, tmp_path, config):
    script = dry_run(capsys, tmp_path / "run", *CPU_NODE, "--job", "sft", str(config), "trainer.total_steps=3")
    assert f"-m {TRAINER_MODULE} --config {config} trainer.total_steps=3 job=sft &" in script


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "0", "--gpus-per-node", "8", *SOME_MODULE], "--nodes must be >= 1, got 0"),
    (["--nodes", "1", "--gpus-per-node", "-1", *SOME_MODULE], "--gpus-per-node must be >= 0"),
    ([*CPU_NODE, "--procs-per-node", "0", *SOME_MODULE], "--procs-per-node must be >= 1"),
    ([*CPU_NODE, "--signal-seconds", "0", *SOME_MODULE], "--signal-seconds must be within 1..65535"),
    ([*CPU_NODE, "--env", "NO_EQUALS", *SOME_MODULE], "--env 'NO_EQUALS' must look like NAME=VALUE"),
    ([*CPU_NODE, "--mounts", "/a:/a", *SOME_MODULE], "--mounts needs --container-image"),
    ([*CPU_NODE, "--module", "not a module"], "is not a python module name"),
    ([*CPU_NODE, "--partition", "gpu large", *SOME_MODULE], "--partition 'gpu large' must not contain spaces"),
    (CPU_NODE, "CONFIG is required to launch the trainer"),
    ([*CPU_NODE, "missing.yaml"], "config file missing.yaml not found"),
    ([*CPU_NODE, "--job", "dpo", *SOME_MODULE], "--job dpo picks the trainer's job"),
])
def test_bad_input_is_refused_and_writes_nothing(capsys, tmp_path, argv, message):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        slurm.main(["--dry-run", "--run-dir", str(run_dir), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not run_dir.exists()


@pytest.mark.parametrize("where, reason", [("run", "File exists"), ("run/sub", "Not a directory")])
def test_a_run_dir_that_cannot_hold_the_script_is_one_line(capsys, tmp_path, where, reason):
    """A file where the folder goes was a FileExistsError traceback; the file is left as it was."""
    (tmp_path / "run").write_text("kept")
    with pytest.raises(SystemExit) as exit_info:
        slurm.main(["--dry-run", "--run-dir", str(tmp_path / where), *CPU_NODE, *SOME_MODULE])
    assert exit_info.value.code == 2
    assert f"error: --run-dir {tmp_path / where}: cannot write sbatch.sh there ({reason})" in capsys.readouterr().err
    assert (tmp_path / "run").read_text() == "kept" and sorted(tmp_path.iterdir()) == [tmp_path / "run"]


FAKE_SRUN = """#!/bin/bash
trap 'echo USR1 > "$FAKE_DIR/forwarded"; exit 0' USR1
echo "${PYTHONSAFEPATH:-}" > "$FAKE_DIR/safe_path"
touch "$FAKE_DIR/started"
[ -z "${FAKE_SRUN_EXIT:-}" ] || exit "$FAKE_SRUN_EXIT"
while :; do sleep 0.05; done
"""


def start_batch_script(capsys, tmp_path, extra_env):
    """Run a rendered script with stand-ins for srun (records USR1) and scontrol, as sbatch would."""
    run_dir = tmp_path / "run"
    dry_run(capsys, run_dir, *CPU_NODE, *SOME_MODULE)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
           "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "7", "SLURM_NNODES": "1", **extra_env}
    return subprocess.Popen(["bash", str(run_dir / "sbatch.sh")], env=env)


def wait_for(path: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def test_batch_script_forwards_the_warning_signal_to_the_step(capsys, tmp_path):
    batch = start_batch_script(capsys, tmp_path, {})
    wait_for(tmp_path / "started")
    batch.send_signal(signal.SIGUSR1)
    assert batch.wait(timeout=20) == 0
    assert (tmp_path / "forwarded").read_text() == "USR1\n"


def test_batch_script_exits_with_the_step_status(capsys, tmp_path):
    batch = start_batch_script(capsys, tmp_path, {"FAKE_SRUN_EXIT": "3"})
    assert batch.wait(timeout=20) == 3


def test_batch_script_keeps_the_working_folder_off_the_ranks_import_path(capsys, tmp_path):
    """srun hands its environment to torchrun and the ranks: PYTHONSAFEPATH=1 (verl_mega.parallel.safe_path)."""
    batch = start_batch_script(capsys, tmp_path, {"FAKE_SRUN_EXIT": "0"})
    assert batch.wait(timeout=20) == 0
    assert (tmp_path / "safe_path").read_text() == "1\n"


def test_submit_names_the_missing_sbatch(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="sbatch not found on PATH"):
        slurm.submit(tmp_path / "sbatch.sh")


@pytest.mark.parametrize("value, seconds", [("5", 300), ("5:30", 330), ("01:02:03", 3723), ("2-0", 172800),
                                            ("1-02:03", 93780), ("1-00:00:10", 86410)])
def test_slurm_time_limits_parse(value, seconds):
    assert slurm.slurm_time_seconds(value) == seconds


def test_warning_signal_must_come_before_the_time_limit(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        slurm.main(["--nodes", "1", "--gpus-per-node", "0", "--time", "5", "--run-dir", str(tmp_path / "run"),
                    "--dry-run", str(config)])
    assert exit_info.value.code == 2
    assert "--signal-seconds 300 must be shorter than --time 5 (300 s)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_rollout_nodes_hand_the_trainer_the_last_nodes_ranks(capsys, tmp_path, config):
    script = dry_run(capsys, tmp_path / "run", "--nodes", "3", "--gpus-per-node", "0", "--procs-per-node", "2",
                     "--rollout-nodes", "1", str(config), "trainer.total_steps=3")
    assert f"-m {TRAINER_MODULE} --config {config} trainer.total_steps=3 parallel.rollout_ranks=2 &" in script
    assert "#SBATCH --nodes=3\n" in script


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "2", "--gpus-per-node", "0", "--rollout-nodes", "2", "CONFIG"],
     "--rollout-nodes 2 must be >= 0 and leave at least one training node of --nodes 2"),
    (["--nodes", "2", "--gpus-per-node", "0", "--rollout-nodes", "1", *SOME_MODULE],
     "--rollout-nodes places the trainer's rollout ranks; it does not apply to --module verl_mega.converters.verify"),
    (["--nodes", "2", "--gpus-per-node", "0", "--rollout-nodes", "1", "CONFIG", "parallel.rollout_ranks=1"],
     "--rollout-nodes sets parallel.rollout_ranks; leave out the override"),
    (["--nodes", "2", "--gpus-per-node", "0", "--rollout-nodes", "1", "CONFIG", "parallel.tp=2"],
     "parallel.rollout_ranks=1 leaves 1 training processes: parallel.tp * parallel.pp = 2 must divide"),
])
def test_rollout_nodes_that_cannot_run_are_refused_and_write_nothing(capsys, tmp_path, config, argv, message):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        slurm.main(["--dry-run", "--run-dir", str(run_dir), *[str(config) if a == "CONFIG" else a for a in argv]])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not run_dir.exists()
