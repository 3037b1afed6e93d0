"""The trainer's checkpoints: everything a run needs to continue exactly where it stopped.

    RUN/checkpoints/step_000012/
        actor/, critic/          model + optimizer + LR schedule (megatron dist_checkpointing, any layout)
        rng/rank_00003.pt        every rank's RNG states
        trainer_state.json       step, sampler position, KL controller, reward normaliser, model fingerprint
        config.yaml              the resolved config of the run that wrote it

A checkpoint is written into `.step_000012.tmp` and renamed when every rank is done, so a folder named
`step_*` is complete; a kill during a save leaves the previous checkpoints untouched.
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
import torch.distributed as dist

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


def save_checkpoint(run_dir: Path, step: int, *, engines: dict, trainer_state: dict, config_yaml: str, rank: int,
                    keep_last: int) -> Path:
    """Collective. `engines`: name -> TrainingEngine (actor, critic). Returns the checkpoint folder."""
    from verl_mega.checkpoint.training_state import save_engine_state

    final = step_dir(run_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in ("rng", *engines):
            (tmp / folder).mkdir(parents=True)
    dist.barrier()
    for name, engine in engines.items():
        save_engine_state(engine, tmp / name)
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        (tmp / "config.yaml").write_text(config_yaml)
        # Written last: its presence marks the content complete before the rename publishes it.
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(ckpt: Path, *, engines: dict, fingerprint: str, rank: int, world_size: int) -> dict:
    """Collective. Restores the engines (at this job's layout) and this rank's RNG; returns the trainer state."""
    from verl_mega.checkpoint.training_state import load_engine_state

    state_file = ckpt / STATE_FILE
    if not state_file.is_file():
        raise ValueError(f"checkpoint {ckpt} is incomplete ({STATE_FILE} missing); remove it to resume from an "
                         "earlier one")
    state = json.loads(state_file.read_text())
    if state.get("model_fingerprint") != fingerprint:
        raise ValueError(f"checkpoint {ckpt} was written for another model (fingerprint "
                         f"{state.get('model_fingerprint')} != {fingerprint}); point trainer.run_dir elsewhere")
    for name, engine in engines.items():
        load_engine_state(engine, ckpt / name)
    # Same world size: each rank takes its own RNG back; another layout starts from rank-derived seeds.
    if state.get("world_size") == world_size:
        set_rng_state(torch.load(ckpt / "rng" / f"rank_{rank:05d}.pt", weights_only=False))
    return state
