"""`verl-mega launch slurm` against a real two-node Slurm cluster on localhost (tests/slurm_cluster.py)."""
import json
import time
from pathlib import Path

import pytest

import launch_payloads
from verl_mega.launch import slurm
from slurm_cluster import FINISHED_STATES, slurm_cluster  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.slow


def launch(monkeypatch, capsys, cluster, run_dir: Path, *argv: str) -> str:
    """Submit through the real CLI entry point and return the job id it printed."""
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    assert slurm.main(["--partition", "debug", "--time", "10", "--run-dir", str(run_dir),
                       "--env", f"PYTHONPATH={launch_payloads.pythonpath()}", *argv]) == 0
    return capsys.readouterr().out.strip()


def finished(cluster, job_id: str, run_dir: Path, timeout: float) -> dict[str, str]:
    fields = cluster.wait_for_job(job_id, timeout=timeout)
    # The log's end: a requeued job's second run follows its first one's (long) shutdown tracebacks there.
    log = "".join(path.read_text() for path in run_dir.glob("slurm-*.out")).splitlines()[-60:]
    assert fields["JobState"] == "COMPLETED", \
        f"job {job_id}: {fields['JobState']}\n" + "\n".join(log) + f"\n{cluster.log_tail()}"
    return fields


def wait_for_file(path: Path, cluster, job_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = cluster.job_fields(job_id)["JobState"]
        assert state not in FINISHED_STATES, f"job {job_id} is {state} before {path.name}"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.5)


def test_two_nodes_two_ranks_each(monkeypatch, capsys, tmp_path, slurm_cluster):  # noqa: F811
    out = tmp_path / "out"
    out.mkdir()
    job_id = launch(monkeypatch, capsys, slurm_cluster, tmp_path / "run",
                    "--nodes", "2", "--gpus-per-node", "0", "--procs-per-node", "2",
                    "--env", "LAUNCH_TEST_MARKER=slurm", "--module", "launch_payloads.allreduce",
                    "--", "--out", str(out))
    finished(slurm_cluster, job_id, tmp_path / "run", timeout=90)
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert {result["world_size"] for result in results} == {4}
    assert {result["sum"] for result in results} == {1.0 + 2.0 + 3.0 + 4.0}
    assert {result["env_marker"] for result in results} == {"slurm"}
    per_node = {}
    for result in results:
        per_node.setdefault(result["node"], []).append(result["local_rank"])
    assert {node: sorted(ranks) for node, ranks in per_node.items()} == {"node1": [0, 1], "node2": [0, 1]}


def test_warning_signal_saves_requeues_and_resumes(monkeypatch, capsys, tmp_path, slurm_cluster):  # noqa: F811
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    job_id = launch(monkeypatch, capsys, slurm_cluster, run_dir,
                    "--nodes", "2", "--gpus-per-node", "0", "--signal-seconds", "30",
                    "--module", "launch_payloads.wait_for_warning", "--", "--out", str(out))
    for rank in range(2):
        wait_for_file(out / f"ready-rank{rank}", slurm_cluster, job_id, timeout=60)
    # What --signal=B:USR1@30 does 30 s before the time limit, without waiting for it.
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    wait_for_file(out / "requeued", slurm_cluster, job_id, timeout=60)
    requeued = slurm_cluster.wait_for_job(job_id, ("PENDING", *FINISHED_STATES), timeout=60)
    assert (requeued["JobState"], requeued["Restarts"]) == ("PENDING", "1")
    # Slurm holds a requeued job for 120 s (Reason=BeginTime); the test does not wait that out.
    slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    fields = finished(slurm_cluster, job_id, run_dir, timeout=90)
    assert fields["Restarts"] == "1"
    assert [(out / f"saved-rank{rank}").read_text() for rank in range(2)] == ["SIGUSR1", "SIGUSR1"]
    assert [(out / f"second-run-rank{rank}").read_text() for rank in range(2)] == ["1", "1"]


# --- the PPO trainer as a Slurm job ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ppo_config(tmp_path_factory):
    """The demo's PPO config on a tiny random model at TP2 (4 ranks: 2 nodes x 2)."""
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("slurm_ppo")
    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    data = write_rows(make_task_rows("copy", 64, seed=0, max_digits=2), root / "copy.jsonl")
    from omegaconf import OmegaConf

    config = root / "ppo.yaml"
    OmegaConf.save(OmegaConf.merge(OmegaConf.load(EXAMPLES / "ppo_gae_demo.yaml"), {
        "model": {"hf_path": str(hf)}, "data": {"train_files": [str(data)], "batch_size": 4},
        "parallel": {"tp": 2, "pp": 1}, "rollout": {"n": 2},
        "actor": {"mini_batch_size": 4, "micro_batch_size": 2}, "critic": {"mini_batch_size": 4, "micro_batch_size": 2},
    }), config)
    return config


def metric_records(run_dir: Path) -> dict[int, dict]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in records}


def test_ppo_run_on_two_nodes_saves_at_the_warning_signal_requeues_resumes_and_matches_an_uninterrupted_run(
        monkeypatch, capsys, tmp_path, slurm_cluster, ppo_config):  # noqa: F811
    """The PPO trainer as a job of 2 nodes x 2 ranks, warned (USR1) after its second step: it saves, is requeued,
    resumes and completes, with the metrics of the same run launched locally in one go and its final weights."""
    from verl_mega.launch import local

    steps = ["trainer.total_steps=6"]
    straight = tmp_path / "straight"
    assert local.main(["--nproc", "4", str(ppo_config), f"trainer.run_dir={straight}", *steps]) == 0

    run_dir = tmp_path / "run"
    job_id = launch(monkeypatch, capsys, slurm_cluster, run_dir, "--nodes", "2", "--gpus-per-node", "0",
                    "--procs-per-node", "2", "--signal-seconds", "60", str(ppo_config),
                    f"trainer.run_dir={run_dir}", *steps)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert slurm_cluster.job_fields(job_id)["JobState"] not in FINISHED_STATES
        assert time.monotonic() < deadline, "the job logged no steps in time"
        time.sleep(0.5)
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    requeued = slurm_cluster.wait_for_job(job_id, ("PENDING", *FINISHED_STATES), timeout=120)
    assert (requeued["JobState"], requeued["Restarts"]) == ("PENDING", "1")
    saved = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")]
    assert saved and not (run_dir / "final_actor").exists()
    slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    finished(slurm_cluster, job_id, run_dir, timeout=240)
    log = "".join(path.read_text() for path in run_dir.glob("slurm-*.out"))
    assert "resumed from" in log
    assert metric_records(run_dir) == metric_records(straight)
    assert sorted(metric_records(run_dir)) == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "final_actor" / "verl_mega_manifest.json").is_file()


def test_converter_verify_runs_as_a_slurm_job(monkeypatch, capsys, tmp_path, slurm_cluster):  # noqa: F811
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(tmp_path / "hf", "llama", num_hidden_layers=2)
    convert_hf_to_mcore(hf, tmp_path / "ckpt", tp=2, pp=1)
    run_dir = tmp_path / "run"
    job_id = launch(monkeypatch, capsys, slurm_cluster, run_dir, "--nodes", "2", "--gpus-per-node", "0",
                    "--procs-per-node", "1", "--module", "verl_mega.converters.verify", "--",
                    "--pair", str(hf), str(tmp_path / "ckpt"), "--tp", "2", "--pp", "1")
    finished(slurm_cluster, job_id, run_dir, timeout=120)
    log = "".join(path.read_text() for path in run_dir.glob("slurm-*.out"))
    assert "max |Δ logit| = " in log
