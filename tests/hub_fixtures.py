"""The Hub tests' server: tests/workers/hub_server.py started as a process on a free localhost port, with
HF_ENDPOINT, HF_HOME and HF_TOKEN set around each test, and the tiny models and datasets the tests publish to it
through huggingface_hub's own upload calls."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from huggingface_hub import HfApi

TOKEN = "hf_test_token"
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class HubServer:
    url: str
    root: Path
    process: subprocess.Popen

    def api(self) -> HfApi:
        return HfApi(endpoint=self.url, token=TOKEN)

    def publish(self, repo_id: str, folder: Path, *, private=False, gated=False, repo_type="model",
                branch: str | None = None) -> str:
        """Create `repo_id` (if new) and commit `folder` to main, or to `branch` (made from main); the commit."""
        api = self.api()
        api.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True)
        if branch:
            api.create_branch(repo_id, repo_type=repo_type, branch=branch, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, repo_type=repo_type, folder_path=folder, revision=branch).oid
        if gated:
            api.update_repo_settings(repo_id, repo_type=repo_type, gated="auto")
        return commit

    def downloads(self) -> list[str]:
        """The file downloads served so far: `GET type/org/name/file START` lines."""
        log = self.root / "requests.log"
        return log.read_text().splitlines() if log.is_file() else []

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def start_hub_server(root: Path, bytes_per_s: int = 0) -> HubServer:
    process = subprocess.Popen([sys.executable, "-m", "tests.workers.hub_server", str(root), "--token", TOKEN,
                                "--bytes-per-s", str(bytes_per_s)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    port = process.stdout.readline().strip()
    if not port:
        process.kill()
        raise RuntimeError("the hub server did not start")
    return HubServer(f"http://127.0.0.1:{port}", root, process)


def hub_env(server: HubServer, home: Path, token: bool = True, offline: bool = False) -> dict[str, str]:
    """The environment variables a process uses the Hub by (HF_TOKEN absent when `token` is False)."""
    env = {"HF_ENDPOINT": server.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1" if offline else "0"}
    if token:
        env["HF_TOKEN"] = TOKEN
    return env


def set_hub_env(monkeypatch, env: dict[str, str]) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def write_split_dataset(folder: Path, rows: list[dict]) -> Path:
    """The Hub's parquet layout: data/train-0000K-of-00002.parquet (two shards) and data/test-00000-of-00001."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    half = len(rows) // 2
    for index, shard in enumerate((rows[:half], rows[half:])):
        pq.write_table(pa.Table.from_pylist(shard), folder / "data" / f"train-{index:05d}-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), folder / "data" / "test-00000-of-00001.parquet")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# rows\n")
    return folder


def clean_env() -> dict[str, str]:
    """os.environ less the Hub variables a test sets itself."""
    return {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
