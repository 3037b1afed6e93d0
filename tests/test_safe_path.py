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
