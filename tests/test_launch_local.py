"""`verl-mega launch local` runs a module under torchrun on this machine."""
import json

import pytest

import launch_payloads
from verl_mega.launch import local


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
