"""A run's step checkpoints: everything a run needs to continue exactly where it stopped.

    RUN/checkpoints/step_000012/
        actor/, critic/          model + optimizer + LR schedule (megatron dist_checkpointing, any layout)
        rng/rank_00003.safetensors  every rank's RNG states (tensors + JSON scalars: no pickle)
        trainer_state.json       step, sampler position, KL controller, reward normaliser, model fingerprint,
                                 the sha256 of each role's base (HF folder) when given
        config.yaml              the resolved config of the run that wrote it
        digests.json             every other file's size and sha256, checked before the checkpoint is read
                                 (`checkpoint_digests`; absent from checkpoints written before it existed)

A checkpoint is written into `.step_000012.tmp` and renamed when every rank is done (`collective_output_dir`),
so a folder named `step_*` is complete; a kill during a save leaves the previous checkpoints untouched.

A LoRA role's folder holds its adapters, not its frozen base (`training_state`): the base is the HF folder the
run starts from, named by its sha256 in trainer_state.json, and a resume on another base is refused.
"""
from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from safetensors import safe_open
from safetensors.torch import save_file

from verl_mega.config.errors import UserError
from verl_mega.files.atomic import collective_output_dir
from verl_mega.models.lora import has_lora

from .checkpoint_digests import DIGESTS_FILE, DIGESTS_KEY, record_digests, verify_digests
from .folder import CONFIG_FILE, STATE_FILE, RunFolder, checkpoint_step
from .training_state import load_training_state, save_training_state

BASES_KEY = "base_sha256"  # trainer_state.json: role -> sha256 of the HF folder the role started from
_TRACKER_PREFIX = "model_parallel/"
# Config fields that define the model's shapes; a checkpoint of another model is refused on them.
_ARCHITECTURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "intermediate_size", "vocab_size", "num_local_experts", "head_dim", "tie_word_embeddings")


def model_fingerprint(hf_config: dict) -> str:
    fields = {key: hf_config.get(key) for key in _ARCHITECTURE_KEYS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp folders of interrupted saves are not listed)."""
    root = RunFolder(run_dir).checkpoints
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := checkpoint_step(p)) is not None and p.is_dir()]
    return [p for _, p in sorted(found)]


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's RNG states as plain tensors plus JSON-able scalars: stored without pickle, so reading a
    checkpoint never executes anything."""
    from megatron.core import tensor_parallel

    version, python_words, gauss_next = random.getstate()
    _, numpy_words, numpy_pos, has_gauss, cached_gaussian = np.random.get_state()
    tensors = {"python": torch.tensor(python_words, dtype=torch.int64),
               "numpy": torch.from_numpy(numpy_words.astype(np.int64)), "torch": torch.get_rng_state()}
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    tensors.update({f"{_TRACKER_PREFIX}{name}": state.cpu() for name, state in tracker.items()})
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    scalars = {"python_version": version, "python_gauss_next": gauss_next, "numpy_pos": int(numpy_pos),
               "numpy_has_gauss": int(has_gauss), "numpy_cached_gaussian": float(cached_gaussian)}
    return tensors, scalars


def set_rng_state(tensors: dict[str, torch.Tensor], scalars: dict) -> None:
    """Restore what `rng_state` returned; raises ValueError/TypeError/RuntimeError/KeyError on a mangled one."""
    from megatron.core import tensor_parallel

    words = {key: tensors[key].tolist() for key in ("python", "numpy")}
    if any(not 0 <= word < 2**32 for key in words for word in words[key]):
        raise ValueError("a Mersenne Twister word is outside 0..2^32-1")
    random.setstate((scalars["python_version"], tuple(words["python"]), scalars["python_gauss_next"]))
    np.random.set_state(("MT19937", np.array(words["numpy"], dtype=np.uint32), int(scalars["numpy_pos"]),
                         int(scalars["numpy_has_gauss"]), float(scalars["numpy_cached_gaussian"])))
    torch.set_rng_state(tensors["torch"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    stored = {key[len(_TRACKER_PREFIX):]: value for key, value in tensors.items() if key.startswith(_TRACKER_PREFIX)}
    if set(stored) != set(current) or any(stored[name].shape != current[name].shape for name in current):
        raise ValueError(f"model-parallel RNG states {sorted(stored)} do not match this job's {sorted(current)}")
    tracker.set_states({name: state.to(current[name].device) for name, state in stored.items()})
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])


def save_rng_state(path: Path) -> None:
    tensors, scalars = rng_state()
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(path),
              metadata={"scalars": json.dumps(scalars)})


def load_rng_state(path: Path) -> None:
    """Restore this rank's RNG from `path`; a missing, truncated or tampered file is a UserError."""
    try:
        with safe_open(str(path), framework="pt") as file:
            tensors = {key: file.get_tensor(key) for key in file.keys()}
            scalars = json.loads((file.metadata() or {})["scalars"])
        set_rng_state(tensors, scalars)
    except Exception as err:  # safetensors' own errors have no common base beyond Exception
        raise UserError(f"{path} is not a valid RNG state ({type(err).__name__}: {err}); remove its checkpoint "
                        f"{path.parent.parent} to resume from an earlier one") from None


def save_checkpoint(run_dir: Path, step: int, *, trainables: dict, trainer_state: dict, config_yaml: str, rank: int,
                    keep_last: int, base_checksums: dict[str, str] | None = None) -> Path:
    """Collective. `trainables`: name -> TrainableModel (actor, critic). `base_checksums`: role -> sha256 of the
    HF folder it started from (the critic's defaults to the actor's), recorded. Returns the checkpoint folder."""
    final = RunFolder(run_dir).step(step)
    trainer_state = {**trainer_state, DIGESTS_KEY: DIGESTS_FILE}
    if base_checksums:
        trainer_state[BASES_KEY] = {role: _base_of(base_checksums, role) for role in trainables}
    with collective_output_dir(final, rank) as tmp:
        for name, trainable in trainables.items():
            (tmp / name).mkdir(exist_ok=True)
            save_training_state(trainable, tmp / name)
        (tmp / "rng").mkdir(exist_ok=True)
        save_rng_state(tmp / "rng" / _rng_file(rank))
        if rank == 0:
            (tmp / CONFIG_FILE).write_text(config_yaml)
            (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
        record_digests(tmp, rank, torch.distributed.get_world_size())
    if rank == 0:
        for old in complete_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(ckpt: Path, *, trainables: dict, fingerprint: str, rank: int, world_size: int,
                    base_checksums: dict[str, str] | None = None,
                    restore_job_state: Callable[[dict], None] | None = None) -> dict:
    """Collective. Restores the trainables (at this job's layout) and this rank's RNG; returns the trainer state.
    `base_checksums` as for `save_checkpoint`: a LoRA role's adapters load only onto the base they were trained on.
    `restore_job_state(state)` takes the job's own part of the trainer state before any weight is read, checking
    every value first: its ValueError (on any rank) is one line naming trainer_state.json and the key."""
    state_file = ckpt / STATE_FILE
    if not state_file.is_file():
        raise UserError(f"checkpoint {ckpt} is incomplete ({STATE_FILE} missing); remove it to resume from an "
                        "earlier one")
    try:
        verify_digests(ckpt, rank, world_size)
    except ValueError as err:
        raise UserError(f"{err}; remove checkpoint {ckpt} to resume from an earlier one") from None
    try:
        state = json.loads(state_file.read_text())
        if not isinstance(state, dict) or type(state.get("step")) is not int or state["step"] < 0:
            raise ValueError("it holds no step count")
    except (OSError, ValueError) as err:
        raise UserError(f"{state_file} is unreadable ({err}); remove {ckpt} to resume from an earlier one") from None
    if state.get("model_fingerprint") != fingerprint:
        raise UserError(f"checkpoint {ckpt} was written for another model (fingerprint "
                        f"{state.get('model_fingerprint')} != {fingerprint}); point trainer.run_dir elsewhere")
    _check_lora_bases(ckpt, state.get(BASES_KEY), trainables, base_checksums)
    if restore_job_state is not None:
        _restore_job_state(restore_job_state, state, state_file, world_size)
    for name, trainable in trainables.items():
        try:
            load_training_state(trainable, ckpt / name)
        except (FileNotFoundError, ValueError) as err:  # incomplete, or of another model or optimizer kind
            raise UserError(f"checkpoint {ckpt}: {err}") from None
    # Same world size: each rank takes its own RNG back; another layout starts from rank-derived seeds.
    if state.get("world_size") == world_size:
        load_rng_state(ckpt / "rng" / _rng_file(rank))
    return state


def _restore_job_state(restore: Callable[[dict], None], state: dict, state_file: Path, world_size: int) -> None:
    """`restore(state)`, its ValueError the same one line on every rank (a rank that checks only its replica's
    partial rollout may be the one to find it)."""
    problem = None
    try:
        restore(state)
    except ValueError as err:
        problem = str(err)
    if world_size > 1:
        gathered = [None] * world_size
        torch.distributed.all_gather_object(gathered, problem)
        problem = next((found for found in gathered if found), None)
    if problem:
        raise UserError(f"{state_file}: {problem}; remove checkpoint {state_file.parent} to resume from an earlier "
                        "one")


def _base_of(base_checksums: dict[str, str], role: str) -> str:
    return base_checksums.get(role, base_checksums["actor"])


def _check_lora_bases(ckpt: Path, saved: dict | None, trainables: dict, base_checksums: dict[str, str] | None) -> None:
    """Adapters are a difference from their base: on another base they are another model. (A checkpoint that
    records no bases predates the record, or its run gave none: nothing to compare.)"""
    if not isinstance(saved, dict) or not base_checksums:
        return
    for role, trainable in trainables.items():
        if role in saved and has_lora(trainable.model) and saved[role] != _base_of(base_checksums, role):
            raise UserError(f"checkpoint {ckpt} holds {role} LoRA adapters trained on a base of sha256 {saved[role]}, "
                            f"but this run's {role} starts from one of sha256 {_base_of(base_checksums, role)}: resume "
                            "with the model the adapters were trained on, or point trainer.run_dir elsewhere")


def _rng_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"
