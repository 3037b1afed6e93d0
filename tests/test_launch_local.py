"""`verl-mega launch local` runs a module under torchrun on this machine, and the trainer on one rank in its own
process."""
import json
import os

import pytest
import torch

import launch_payloads
from verl_mega.data.synthetic import make_task_rows
from verl_mega.data.tables import write_rows
from verl_mega.launch import local
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.run.folder import RunFolder
from verl_mega.trainer.plot import read_metrics

ONE_STEP_GRPO = """
data: {max_prompt_length: 32, max_response_length: 4, batch_size: 2, truncation: error}
rollout: {n: 2}
actor: {mini_batch_size: 4, micro_batch_size: 4}
critic: {enable: false, mini_batch_size: 4, micro_batch_size: 4}
algorithm: {adv_estimator: grpo}
reward: {function: copy}
trainer: {total_steps: 1, progress_bar: false}
"""


@pytest.mark.slow
def test_local_launch_runs_every_rank(tmp_path):
    status = local.main(["--nproc", "2", "--module", "launch_payloads.allreduce", "--env",
                         f"PYTHONPATH={launch_payloads.pythonpath()}", "--env", "LAUNCH_TEST_MARKER=local",
                         "--", "--out", str(tmp_path)])
    assert status == 0
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [result["sum"] for result in results] == [3.0, 3.0]
    assert {result["env_marker"] for result in results} == {"local"}


def test_local_launch_refuses_zero_ranks(capsys):
    with pytest.raises(SystemExit):
        local.main(["--nproc", "0", "--module", "launch_payloads.allreduce"])
    assert "--nproc must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "1", "--rollout-nproc", "-1", "--module", "launch_payloads.allreduce"], "--rollout-nproc must be >= 0"),
    (["--nproc", "1", "--rollout-nproc", "1", "--module", "launch_payloads.allreduce"],
     "--rollout-nproc places the trainer's rollout ranks; it does not apply to --module launch_payloads.allreduce"),
])
def test_local_launch_refuses_rollout_ranks_it_cannot_place(capsys, argv, message):
    with pytest.raises(SystemExit):
        local.main(argv)
    assert message in capsys.readouterr().err


def test_one_trainer_rank_trains_in_the_launchers_process_as_torchrun_s_only_rank(tmp_path, monkeypatch):
    """No torchrun agent: the trainer trains here, in a world of one on its own port, whatever the launcher's
    environment says about Slurm or a rendezvous, and the environment is the launcher's again after."""
    def no_agent(*args, **kwargs):
        raise AssertionError("a one-rank trainer launch started torchrun")

    monkeypatch.setattr(local, "run_torchrun", no_agent)
    for name, value in (("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4"), ("MASTER_ADDR", "192.0.2.1"),
                        ("MASTER_PORT", "9")):  # a world of 4 and an unreachable rendezvous, were they read
        monkeypatch.setenv(name, value)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    pool, pool_sizes, set_pool = torch.get_num_threads(), [], torch.set_num_threads
    set_pool(2)  # the launcher's pool, which is not the rank's
    monkeypatch.setattr(local.torch, "set_num_threads", lambda size: (pool_sizes.append(size), set_pool(size)))
    config = tmp_path / "grpo.yaml"
    config.write_text(ONE_STEP_GRPO)
    model = make_tiny_hf_model(tmp_path / "hf", "qwen2")
    data = write_rows(make_task_rows("copy", 2, seed=0), tmp_path / "copy.jsonl")
    run_dir = tmp_path / "run"

    # (the trainer's stop handlers, and the command's ignored Ctrl-C once all is saved, are this process's now:
    # conftest's fixture puts them back for the tests after it)
    status = local.main(["--nproc", "1", str(config), f"model.hf_path={model}", f"data.train_files=[{data}]",
                         f"trainer.run_dir={run_dir}"])

    assert status == 0
    assert [record["step"] for record in read_metrics(RunFolder(run_dir).metrics)] == [1]
    assert "WORLD_SIZE" not in os.environ and os.environ["MASTER_ADDR"] == "192.0.2.1"
    # the rank's one thread (torchrun's default) while it trained; the launcher's variable and pool after
    assert pool_sizes == [1, 2] and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() == 2
    set_pool(pool)


def test_a_trainer_launch_with_env_variables_keeps_the_torchrun_agent(tmp_path, monkeypatch):
    """--env names variables read as the rank's interpreter starts, which this process has passed."""
    launched = []
    monkeypatch.setattr(local, "run_torchrun", lambda *args, **kwargs: launched.append((args, kwargs)))
    config = tmp_path / "grpo.yaml"
    config.write_text(ONE_STEP_GRPO)
    model = make_tiny_hf_model(tmp_path / "hf", "qwen2")
    data = write_rows(make_task_rows("copy", 2, seed=0), tmp_path / "copy.jsonl")

    status = local.main(["--nproc", "1", "--env", "MKL_NUM_THREADS=1", str(config), f"model.hf_path={model}",
                         f"data.train_files=[{data}]", f"trainer.run_dir={tmp_path / 'run'}"])

    assert status == 0
    assert [(args[:2], kwargs["env"]["MKL_NUM_THREADS"]) for args, kwargs in launched] == [
        ((1, local.TRAINER_MODULE), "1")]
