"""A clean stop: SIGTERM or Ctrl-C finishes the step, saves it, and ends with one line saying where the run stopped
and how to resume and export from there; the launchers hand each signal down to the ranks once."""
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_mega.config.errors import UserError
from verl_mega.demo import EXAMPLES
from verl_mega.parallel.stop_signals import child_pids, forwarding
from verl_mega.trainer.preemption import StopRequest, stop_line

from trainer_runs import make_inputs

VERL_MEGA = str(Path(sys.executable).with_name("verl-mega"))


def test_a_first_ctrl_c_asks_a_second_stops_at_once_and_the_handlers_are_given_back():
    before = signal.getsignal(signal.SIGINT)
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop() and stop.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before


def failing_reward(data_source, response, ground_truth, extra_info=None):
    raise ValueError("planted")


def test_a_failed_run_keeps_the_stop_handlers_through_its_teardown_then_gives_them_back(monkeypatch, tmp_path):
    """A launcher SIGTERMs every rank as soon as one dies; a rank whose run has failed must not be killed by it
    while it tears down, before it has said why it failed. So the run's stop handlers stay until the process
    group is gone, and only then are the caller's back. Could fail if the handlers were given back as the job
    ended (SIGTERM would end the process in destroy_parallel's time)."""
    from verl_mega.config import load_config
    from verl_mega.trainer import main as trainer_main

    root, hf, data = make_inputs(tmp_path)
    config = load_config(str(EXAMPLES / "grpo_demo.yaml"), [
        f"model.hf_path={hf}", f"data.train_files=[{data}]", f"trainer.run_dir={tmp_path / 'run'}",
        "data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
        "trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0"])
    seen = []
    destroy = trainer_main.destroy_parallel

    def destroy_and_record():
        seen.append(signal.getsignal(signal.SIGTERM))
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, mid-teardown: recorded, not fatal
        destroy()

    monkeypatch.setattr(trainer_main, "destroy_parallel", destroy_and_record)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(UserError, match="raised ValueError: planted"):
        trainer_main.run(config, reward_fn=failing_reward)
    assert len(seen) == 1 and isinstance(seen[0].__self__, StopRequest)
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_line_names_step_checkpoint_and_commands(monkeypatch, tmp_path):
    monkeypatch.setenv("VERL_MEGA_COMMAND", "verl-mega launch local --nproc 2 run.yaml")
    checkpoint = tmp_path / "checkpoints" / "step_000012"
    line = stop_line(signal.SIGTERM, 12, 50, checkpoint, tmp_path, None)
    assert line == (f"stopped by SIGTERM at step 12 of 50: checkpoint {checkpoint} holds it; to resume, run "
                    f"verl-mega launch local --nproc 2 run.yaml again; to export it, verl-mega export --ckpt "
                    f"{tmp_path} --step 12 --out OUT_DIR")
    assert "Slurm requeues job 77, which resumes from it by itself" in stop_line(
        signal.SIGUSR1, 12, 50, checkpoint, tmp_path, "77")
    assert stop_line(signal.SIGINT, 0, 50, None, tmp_path, None).endswith("no checkpoint was saved")


def test_forwarding_hands_the_signal_to_the_targets_and_acts_here_without_any():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with forwarding(lambda: [child.pid]) as passed:
            os.kill(os.getpid(), signal.SIGTERM)  # would end this process without the forwarding
        assert child.wait(timeout=30) == -signal.SIGTERM and passed == [signal.SIGTERM]
    finally:
        child.kill()
        child.wait()
    # Python's own SIGINT handler beforehand (an xdist worker's may have been left ignored by a fixture that ran the
    # trainer in-process): with no target the signal acts here through it, as KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with forwarding(lambda: []), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_child_pids_are_this_process_s_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.pid in child_pids() and child.pid not in child_pids(child.pid)
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
def test_sigterm_to_a_local_launch_saves_says_where_and_its_commands_resume_and_export(tmp_path):
    root, hf, data = make_inputs(tmp_path)
    run_dir, env = tmp_path / "run", {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [VERL_MEGA, "launch", "local", "--nproc", "1", str(EXAMPLES / "grpo_demo.yaml"), f"model.hf_path={hf}",
               f"data.train_files=[{data}]", f"trainer.run_dir={run_dir}", "data.batch_size=4", "rollout.n=2",
               "actor.mini_batch_size=4", "actor.micro_batch_size=2", "trainer.total_steps=40",
               "trainer.save_every=0", "trainer.val_every=0"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=tmp_path)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 600
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, stderr[-3000:]

    # What a person saw before the first step: each phase's start (the heartbeat fills any silence past 30 s).
    assert "loading the models from " in stdout and "step 1: the first rollout (4 prompts x 2) ..." in stdout
    lines = [line for line in stdout.splitlines() if line.startswith("stopped by")]
    assert len(lines) == 1, stdout
    found = re.fullmatch(r"stopped by SIGTERM at step (\d+) of 40: checkpoint (\S+) holds it; to resume, run (.+) "
                         r"again; to export it, (.+)", lines[0])
    assert found, lines[0]
    step, checkpoint, resume, export = int(found[1]), Path(found[2]), found[3], found[4]
    assert 2 <= step < 40 and checkpoint == run_dir / "checkpoints" / f"step_{step:06d}" and checkpoint.is_dir()
    assert shlex.split(resume) == ["verl-mega", *command[1:]]

    exported = tmp_path / "exported"
    subprocess.run([VERL_MEGA, *shlex.split(export.replace("OUT_DIR", str(exported)))[1:]], check=True, env=env,
                   capture_output=True)
    assert (exported / "config.json").is_file()
    resumed = subprocess.run([VERL_MEGA, *shlex.split(resume)[1:]], capture_output=True, text=True, env=env,
                             cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stdout and "step 40:" in resumed.stdout
