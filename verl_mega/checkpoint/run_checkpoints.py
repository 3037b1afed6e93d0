"""A run's step checkpoints: everything a run needs to continue exactly where it stopped.

    RUN/checkpoints/step_000012/
        actor/, critic/          model + optimizer + LR schedule (megatron dist_checkpointing, any layout)
        rng/rank_00003.pt        every rank's RNG states
        trainer_state.json       step, sampler position, KL controller, reward normaliser, model fingerprint
        config.yaml              the resolved config of the run that wrote it

A checkpoint is written into `.step_000012.tmp` and renamed when every rank is done (`collective_output_dir`),
so a folder named `step_*` is complete; a kill during a save leaves the previous checkpoints untouched.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from .atomic import collective_output_dir
from .training_state import load_training_state, save_training_state

CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
# Config fields that define the model's shapes; a checkpoint of another model is refused on them.
_ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "intermediate_size", "vocab_size", "num_local_experts", "head_dim", "tie_word_embeddings")


def model_fingerprint(hf_config: dict) -> str:
    fields = {key: hf_config.get(key) for key in _ARCHITECTURE_KEYS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp folders of interrupted saves are not listed)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "model_parallel": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["model_parallel"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, *, trainables: dict, trainer_state: dict, config_yaml: str, rank: int,
                    keep_last: int) -> Path:
    """Collective. `trainables`: name -> TrainableModel (actor, critic). Returns the checkpoint folder."""
    final = step_dir(run_dir, step)
    with collective_output_dir(final, rank) as tmp:
        for name, trainable in trainables.items():
            (tmp / name).mkdir(exist_ok=True)
            save_training_state(trainable, tmp / name)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
        if rank == 0:
            (tmp / "config.yaml").write_text(config_yaml)
            (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
    if rank == 0:
        for old in complete_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(ckpt: Path, *, trainables: dict, fingerprint: str, rank: int, world_size: int) -> dict:
    """Collective. Restores the trainables (at this job's layout) and this rank's RNG; returns the trainer state."""
    state_file = ckpt / STATE_FILE
    if not state_file.is_file():
        raise ValueError(f"checkpoint {ckpt} is incomplete ({STATE_FILE} missing); remove it to resume from an "
                         "earlier one")
    state = json.loads(state_file.read_text())
    if state.get("model_fingerprint") != fingerprint:
        raise ValueError(f"checkpoint {ckpt} was written for another model (fingerprint "
                         f"{state.get('model_fingerprint')} != {fingerprint}); point trainer.run_dir elsewhere")
    for name, trainable in trainables.items():
        load_training_state(trainable, ckpt / name)
    # Same world size: each rank takes its own RNG back; another layout starts from rank-derived seeds.
    if state.get("world_size") == world_size:
        set_rng_state(torch.load(ckpt / "rng" / f"rank_{rank:05d}.pt", weights_only=False))
    return state
