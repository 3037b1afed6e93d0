"""The Python API: the jobs of `verl-mega train | sft | preference` from a script, and the trained policy back.

`Trainer` builds the TrainConfig the command line builds and calls the same `trainer.main.run`; a reward
function is handed to the job as the callable it is. A plain process trains as a world of one (CPU, or one
GPU); under torchrun every rank runs the same script and trains its share, as with `verl-mega train`.
`load_policy` reads the trained actor from a run folder, a step checkpoint or an exported HF folder.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AutoModelForCausalLM

from verl_mega.algorithms import ADV_ESTIMATORS, PREFERENCE_LOSSES
from verl_mega.config import ConfigError, TrainConfig, load_config
from verl_mega.config.errors import UserError
from verl_mega.converters.export import export_role
from verl_mega.data.prompts import as_messages, encode_chat
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.hub import model_ref, resolve_model
from verl_mega.rewards.registry import RewardFn, reward_fn_name
from verl_mega.run.folder import RunFolder
from verl_mega.trainer.main import run

# The algorithm name of PPO proper: GAE advantages from a learned critic (the other estimators need none).
GAE_WITH_CRITIC = "ppo"


def algorithm_settings(algorithm: str) -> dict[str, str]:
    """Config values for an algorithm name: "sft", a preference loss (dpo, ipo, kto, simpo, orpo), "ppo" or an
    advantage estimator (grpo, rloo, ...)."""
    if algorithm == "sft":
        return {"job": "sft"}
    if algorithm in PREFERENCE_LOSSES.names():
        return {"job": "preference", "algorithm.loss": algorithm}
    if algorithm == GAE_WITH_CRITIC:
        return {"job": "rl", "algorithm.adv_estimator": "gae"}
    if algorithm in ADV_ESTIMATORS.names():
        return {"job": "rl", "algorithm.adv_estimator": algorithm}
    known = ["sft", GAE_WITH_CRITIC, *ADV_ESTIMATORS.names(), *PREFERENCE_LOSSES.names()]
    raise ConfigError(f"algorithm {algorithm!r} is unknown; known: {', '.join(dict.fromkeys(known))}")


class Trainer:
    """One training run. `actor` (and `critic`) are HF model folders or Hub ids `org/name[@revision]`;
    `train_data` / `val_data` a parquet or jsonl file, an HF `datasets` folder (`save_to_disk`), Hub data
    `hf://datasets/org/name[@revision]/path`, or a list of them; `reward_fn` a function
    `fn(data_source, response, ground_truth, extra_info) -> float`, a registered name or "module:function";
    `config` a YAML file or a dict of dotted keys ({"trainer.total_steps": 20}), which the arguments override.
    Bad settings raise UserError naming the key, before any process group starts."""

    def __init__(self, algorithm: str = "grpo", *, actor: str | os.PathLike, train_data, critic=None,
                 reward_fn: RewardFn | str | None = None, val_data=None, run_dir: str | os.PathLike | None = None,
                 config: str | os.PathLike | dict[str, Any] | None = None):
        if config is not None and not isinstance(config, (dict, str, os.PathLike)):
            raise UserError(f"config: {type(config).__name__} given; pass a YAML file or a dict of dotted keys")
        values = dict(config) if isinstance(config, dict) else {}
        values.update(algorithm_settings(algorithm))
        values.update({"model.hf_path": _path(actor, "actor"), "data.train_files": _files(train_data, "train_data")})
        if run_dir is not None:  # else the config's (trainer.run_dir, runs/default by default)
            values["trainer.run_dir"] = _path(run_dir, "run_dir")
        if critic is not None:
            values["model.critic_hf_path"] = _path(critic, "critic")
        if val_data is not None:
            values["data.val_files"] = _files(val_data, "val_data")
        self.reward_fn = None
        if isinstance(reward_fn, str):
            values["reward.function"] = reward_fn
        elif reward_fn is not None:
            if not callable(reward_fn):
                raise UserError(f"reward_fn: {reward_fn!r} is neither a function nor a name / 'module:function'")
            self.reward_fn = reward_fn
            values["reward.function"] = reward_fn_name(reward_fn)  # what config.yaml records; the callable scores
        yaml_file = None if config is None or isinstance(config, dict) else config
        self.config: TrainConfig = load_config(yaml_file, values=values)

    @property
    def run_folder(self) -> RunFolder:
        """The paths of the run's folder: metrics, checkpoints, final weights, ..."""
        return RunFolder(self.config.trainer.run_dir)

    @property
    def run_dir(self) -> Path:
        return self.run_folder.root

    def train(self) -> Path:
        """Train to trainer.total_steps (resuming from the run folder's newest checkpoint); returns the run folder."""
        run(self.config, reward_fn=self.reward_fn)
        return self.run_dir


def _files(data, argument: str) -> list[str]:
    paths = [data] if isinstance(data, (str, os.PathLike)) else list(data) if isinstance(data, (list, tuple)) else []
    if not paths or not all(isinstance(path, (str, os.PathLike)) for path in paths):
        raise UserError(f"{argument}: give a file or datasets folder path (or hf://datasets/...), or a list of them; "
                        f"got {data!r}")
    return [os.fspath(path) for path in paths]


def _path(value, argument: str) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise UserError(f"{argument}: give a folder path (a str or os.PathLike); got {value!r}")
    return os.fspath(value)


class Policy:
    """A trained actor as a transformers model, generating replies to chat prompts."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model.eval(), tokenizer

    @torch.no_grad()
    def generate(self, prompt: str | Sequence[dict], max_new_tokens: int = 64, temperature: float = 0.0,
                 **generate_kwargs) -> str:
        """The reply to `prompt` (chat messages, or a string as one user turn), rendered by the tokenizer's chat
        template; greedy unless `temperature` > 0."""
        ids = encode_chat(self.tokenizer, as_messages(prompt), add_generation_prompt=True)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        output = self.model.generate(torch.tensor([ids], device=self.model.device), max_new_tokens=max_new_tokens,
                                     pad_token_id=self.tokenizer.pad_token_id, **sampling, **generate_kwargs)
        return self.tokenizer.decode(output[0, len(ids):], skip_special_tokens=True)


def load_policy(path: str | os.PathLike, *, step: int | None = None, dtype: str | None = None,
                device: str | torch.device = "cpu") -> Policy:
    """The actor of a run folder (its final weights, or `step`'s checkpoint), of a converted checkpoint, or an
    HF folder (`verl-mega export`'s output), or a Hub id `org/name[@revision]` (docs/hub.md)."""
    ref = model_ref(path) if step is None else None
    if ref is not None:
        return _load_hf(resolve_model(ref).path, device)
    path = Path(path)
    if (path / "config.json").is_file() and step is None:
        return _load_hf(path, device)
    if not path.is_dir():
        raise UserError(f"{path} is not a run folder, a checkpoint or an HF model folder")
    with tempfile.TemporaryDirectory(prefix="verl_mega_policy_") as tmp:
        try:
            export_role(path, Path(tmp) / "actor", role="actor", step=step, dtype=dtype)
        except (ValueError, FileNotFoundError) as err:
            raise UserError(f"cannot load a policy from {path}: {err}") from None
        return _load_hf(Path(tmp) / "actor", device)


def _load_hf(folder: Path, device) -> Policy:
    model = AutoModelForCausalLM.from_pretrained(folder).to(device)
    return Policy(model, load_tokenizer(folder))
