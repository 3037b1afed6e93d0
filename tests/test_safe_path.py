"""No Python process the project starts imports from the working folder: a file planted there under the name of
a module the process imports (it writes a proof file when it runs) never runs, and the process does its work."""
import json
from pathlib import Path

import pytest

import launch_payloads
from verl_mega.launch import local
from verl_mega.rewards.results import Scored
from verl_mega.rewards.worker import ScoringWorker

PLANTED = "from pathlib import Path\nPath(__file__).with_suffix('.ran').write_text('ran')\n"


def plant(folder: Path, *modules: str) -> list[Path]:
    """`modules` as planted files in `folder`; the proof files they would write."""
    for module in modules:
        (folder / f"{module}.py").write_text(PLANTED)
    return [folder / f"{module}.ran" for module in modules]


@pytest.mark.slow
def test_the_reward_worker_imports_nothing_from_the_working_folder(tmp_path, monkeypatch):
    proofs = plant(tmp_path, "signal", "ctypes", "resource")  # the worker's own first imports
    monkeypatch.chdir(tmp_path)
    worker = ScoringWorker("exact_match", timeout_s=30.0, memory_limit_mb=0)
    try:
        assert worker.score([(None, "7", "7", None)]) == [Scored(1.0, {}, {})]
    finally:
        worker.close()
    assert [proof for proof in proofs if proof.exists()] == []


@pytest.mark.slow
def test_torchrun_and_its_ranks_import_nothing_from_the_working_folder(tmp_path, monkeypatch):
    proofs = plant(tmp_path, "json", "argparse", "socket")  # the agent's and the payload's imports
    monkeypatch.chdir(tmp_path)
    status = local.main(["--nproc", "1", "--module", "launch_payloads.allreduce", "--env",
                         f"PYTHONPATH={launch_payloads.pythonpath()}", "--", "--out", str(tmp_path)])
    assert status == 0
    assert json.loads((tmp_path / "rank0.json").read_text())["sum"] == 1.0
    assert [proof for proof in proofs if proof.exists()] == []


def test_a_rank_run_in_its_launchers_process_imports_nothing_from_the_working_folder(tmp_path, monkeypatch):
    """`python -m verl_mega.launch.local` puts the working folder first on sys.path; the one-rank trainer that runs
    in that process (`without_working_folder`) imports as a rank under PYTHONSAFEPATH=1 would."""
    import importlib
    import sys

    from verl_mega.parallel.safe_path import without_working_folder

    proofs = plant(tmp_path, "planted_by_a_user")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    with without_working_folder():
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("planted_by_a_user")
    assert sys.path[0] == str(tmp_path)
    assert [proof for proof in proofs if proof.exists()] == []
