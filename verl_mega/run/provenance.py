"""`RUN/provenance.json`: what a run was made from, so a result can be traced back and reproduced.

The model's sha256 (its config and weight files), the package's version and commit, and the reward function
(a registered name, or the sha256 of a function's source). The commit comes from `VERL_MEGA_COMMIT` (the
Docker image bakes it in), else from `git` when the package is imported from a git checkout, else "unknown".
A model or data file that came from the Hub also records where: its repo id, the commit its revision resolved
to and the refs (branches, tags) that named it.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from verl_mega.checkpoint.hf_assets import model_sha256
from verl_mega.config import TrainConfig
from verl_mega.files.atomic import atomic_write_text
from verl_mega.hub import hub_origin
from verl_mega.rewards.registry import RewardFn, reward_fn_provenance

from .folder import RunFolder

COMMIT_ENV = "VERL_MEGA_COMMIT"
# The checkout the package sits in when it is imported from one (an editable install): repo/verl_mega/run.
_CHECKOUT = Path(__file__).resolve().parents[2]


def package_version() -> str:
    try:
        return version("verl_mega")
    except PackageNotFoundError:
        return "unknown"


def package_commit() -> str:
    baked = os.environ.get(COMMIT_ENV, "").strip()
    if baked:
        return baked
    try:
        top = _git("rev-parse", "--show-toplevel")
        if Path(top).resolve() != _CHECKOUT:  # a git repo that merely contains an installed copy
            return "unknown"
        commit = _git("rev-parse", "HEAD")
        return commit + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(_CHECKOUT), *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


def reward_provenance(config: TrainConfig, reward_fn: RewardFn | None) -> dict | None:
    """What scores the responses: the scoring service (its URL), the reward model's checksum, or the reward
    function's record; None for the jobs that learn from their data alone."""
    if config.job != "rl":
        return None
    remote = config.reward.remote
    if remote.url:  # the service's own version is the team's to record
        return {"remote": remote.url, "kind": remote.kind, **({"model": remote.model} if remote.kind == "judge" else {})}
    if config.reward.reward_model:
        return _with_hub({"reward_model": config.reward.reward_model,
                          "sha256": model_sha256(config.reward.reward_model)}, config.reward.reward_model)
    if not (reward_fn or config.reward.function):  # on-policy distillation: the teacher's signal alone
        teacher = config.teacher.ckpt or config.teacher.hf_path
        return _with_hub({"teacher": teacher}, teacher)
    return reward_fn_provenance(reward_fn or config.reward.function)


def write_provenance(run_dir: Path, config: TrainConfig, checksums: dict[str, str],
                     reward_fn: RewardFn | None = None) -> Path:
    """Rank 0, once per run start (`checksums`: role -> sha256 of the HF folder it started from); a resumed run
    records what it resumed with (the file is replaced)."""
    record = {
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": _with_hub({"path": config.model.hf_path, "sha256": checksums["actor"]}, config.model.hf_path),
        "verl_mega": {"version": package_version(), "commit": package_commit()},
        "reward": reward_provenance(config, reward_fn),
    }
    if "critic" in checksums:
        record["critic"] = _with_hub({"path": config.model.critic_hf_path, "sha256": checksums["critic"]},
                                     config.model.critic_hf_path)
    data = _hub_data(config)
    if data:
        record["data"] = data
    return atomic_write_text(RunFolder(run_dir).provenance, json.dumps(record, indent=2) + "\n")


def _with_hub(entry: dict, path: str) -> dict:
    origin = hub_origin(path)
    return {**entry, "hub": origin} if origin else entry


def _hub_data(config: TrainConfig) -> list[dict]:
    """The Hub datasets the run's data files came from, each once: {"id", "type", "commit", "refs", "files"}."""
    datasets: dict[tuple[str, str], dict] = {}
    for path in [*config.data.train_files, *config.data.val_files]:
        origin = hub_origin(path)
        if origin:
            file = origin.pop("path", "")
            datasets.setdefault((origin["id"], origin["commit"]), {**origin, "files": []})["files"].append(file)
    return list(datasets.values())
