"""`parallel.world`: rank, local rank, world size and rendezvous read once, from torchrun's variables, else
Slurm's (tasks started by `srun` without torchrun), else a single process; and `init_parallel` building its
group from them in plain processes of an `srun`-style job."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from verl_mega.parallel.world import first_host, read_world, slurm_port

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "node-a", "MASTER_PORT": "29400"}
SLURM = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODELIST": "gpu[03-04]",
         "SLURM_JOB_ID": "123456"}


def test_torchrun_variables_are_the_world():
    world = read_world({**TORCHRUN, **SLURM})  # torchrun under srun: torchrun's own variables win
    assert (world.rank, world.local_rank, world.size, world.master_addr, world.master_port) == (5, 1, 8, "node-a",
                                                                                                 29400)
    assert world.torchrun_environment() == TORCHRUN


def test_slurm_variables_are_the_world_without_torchrun():
    world = read_world(SLURM)
    # The port as launch/templates/sbatch.sh derives it from the job id: every task computes the same one.
    assert (world.rank, world.local_rank, world.size, world.master_addr, world.master_port) == (5, 1, 8, "gpu03",
                                                                                                 15000 + 123456 % 20000)
    assert read_world({**SLURM, "SLURM_JOB_ID": "123457"}).master_port == world.master_port + 1


def test_the_sbatch_script_and_the_world_derive_the_same_port_a_new_one_per_restart():
    """launch/templates/sbatch.sh computes MASTER_PORT in bash, `slurm_port` in Python: the same number for any
    job id and restart count, and a requeued run's port is not its predecessor's (nor the next job's)."""
    template = (REPO / "launch" / "templates" / "sbatch.sh").read_text()
    lines = [line for line in template.splitlines() if line.startswith(("restart=", "MASTER_PORT="))]
    assert len(lines) == 2, lines
    for job_id, restarts in ((1, 0), (2, 1), (123456, 0), (123456, 3), (19999, 2)):
        env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": str(job_id), "SLURM_RESTART_COUNT": str(restarts)}
        bash = subprocess.run(["bash", "-c", "\n".join([*lines, "echo $MASTER_PORT"])], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()
        assert int(bash) == slurm_port(env)
    first = {"SLURM_JOB_ID": "123456"}
    assert slurm_port(first) == slurm_port({**first, "SLURM_RESTART_COUNT": "0"})
    requeued = slurm_port({**first, "SLURM_RESTART_COUNT": "1"})
    assert requeued not in (slurm_port(first), slurm_port({"SLURM_JOB_ID": "123457"}))


def test_an_exported_rendezvous_is_kept_under_slurm():
    world = read_world({**SLURM, "MASTER_ADDR": "login1", "MASTER_PORT": "23456"})
    assert (world.master_addr, world.master_port) == ("login1", 23456)


def test_the_steps_node_list_comes_first():
    env = {**SLURM, "SLURM_JOB_NODELIST": "cpu[1-9]", "SLURM_NODELIST": "cpu[1-9]", "SLURM_STEP_NODELIST": "gpu7"}
    assert read_world(env).master_addr == "gpu7"
    del env["SLURM_NODELIST"], env["SLURM_STEP_NODELIST"]
    assert read_world(env).master_addr == "cpu1"


@pytest.mark.parametrize("nodelist, host", [
    ("node7", "node7"),
    ("gpu[01-04,07],cpu3", "gpu01"),
    ("gpu[07,01-04]", "gpu07"),
    ("cpu3,gpu[01-04]", "cpu3"),
    ("rack[1-2]-n[08-09],login1", "rack1-n08"),
    ("a100-[0005-0012]", "a100-0005"),
    ("n.example.org", "n.example.org"),
])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "gpu[01-04", "gpu]", "gpu 01"])
def test_a_node_list_that_is_not_slurms_is_refused(nodelist):
    with pytest.raises(ValueError, match="not in Slurm's syntax"):
        first_host(nodelist)


def test_without_a_launcher_a_single_process_on_this_machine():
    world = read_world({})
    assert (world.rank, world.local_rank, world.size, world.master_addr) == (0, 0, 1, "127.0.0.1")
    with socket.socket() as sock:  # a port nobody holds: a world of one needs no agreed port
        sock.bind(("127.0.0.1", world.master_port))


def test_free_ports_lie_below_the_ephemeral_range_whatever_random_is_seeded_with(monkeypatch, tmp_path):
    import random

    from verl_mega.parallel import spawn

    low = spawn._ephemeral_low()
    random.seed(0)
    first = spawn.free_port()
    random.seed(0)  # two seeded jobs side by side drew the same port from `random`
    ports = {first} | {spawn.free_port() for _ in range(7)}
    assert len(ports) > 1
    if low > spawn.LOWEST_PICKED_PORT:  # any outgoing connection may take a port of the kernel's range meanwhile
        assert all(spawn.LOWEST_PICKED_PORT <= port < low for port in ports), (ports, low)
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024\t60999\n")  # no room below the range: the kernel's choice, still free now
    monkeypatch.setattr(spawn, "_EPHEMERAL_RANGE", range_file)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", spawn.free_port()))


@pytest.mark.parametrize("env, words", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "rank 2 is outside a world of 2"),
    ({**SLURM, "SLURM_JOB_ID": ""}, "SLURM_JOB_ID='' is not an integer"),
    ({key: value for key, value in SLURM.items() if key != "SLURM_JOB_ID"}, "SLURM_JOB_ID is not set"),
    ({key: value for key, value in SLURM.items() if key != "SLURM_NODELIST"}, "export MASTER_ADDR"),
])
def test_a_world_that_cannot_be_read_names_the_variable(env, words):
    with pytest.raises(ValueError, match=words):
        read_world(env)


def free_slurm_job_id() -> int:
    """A job id whose derived port (15000 + id % 20000) nobody holds on this machine."""
    for job_id in range(os.getpid() % 20000, os.getpid() % 20000 + 20000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", 15000 + job_id % 20000))
            except OSError:
                continue
            return job_id
    raise RuntimeError("no free port in 15000..35000")


@pytest.mark.slow
def test_srun_tasks_without_torchrun_form_one_group(tmp_path):
    """Two plain processes with only Slurm's variables: one gloo group of 2, each at its SLURM_PROCID, meeting
    at the node list's first host and the job's port, with the world exported as torchrun's variables while the
    group lives (vLLM reads them) and taken back after."""
    job_id = free_slurm_job_id()
    plain = {key: value for key, value in os.environ.items() if key not in TORCHRUN and not key.startswith("SLURM_")}
    tasks = [subprocess.Popen([sys.executable, "-m", "tests.workers.world_worker", str(tmp_path)], cwd=REPO, env={
        **plain, "OMP_NUM_THREADS": "1", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
        "SLURM_NODELIST": "localhost,gpu[02-03]", "SLURM_JOB_ID": str(job_id)}) for rank in range(2)]
    assert [task.wait(timeout=600) for task in tasks] == [0, 0]
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (record["rank"], record["world_size"], record["gathered_ranks"]) == (rank, 2, [0, 1])
        assert record["environment"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                         "MASTER_ADDR": "localhost", "MASTER_PORT": str(15000 + job_id % 20000)}
        assert set(record["environment_after"].values()) == {None}
