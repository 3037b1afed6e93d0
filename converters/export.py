"""What `verl-mega export --ckpt X [--step N] --role R` reads, and the export itself.

X may be a verl_mega checkpoint (converted, or a role's final weights), a run folder (its final weights, or
with --step N that step's), a step checkpoint (RUN/checkpoints/step_N) or a role's folder inside one. A step
checkpoint holds each role's training state, model and optimizer, as a megatron dist checkpoint: its model
weights are exported, the optimizer is not read. The model's config, vocabulary and tokenizer files come from
the checkpoint the role started from (named in the step's config.yaml, or converted into the run folder).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from verl_mega.checkpoint.manifest import HF_ASSETS_DIR, MANIFEST_NAME, Manifest
from verl_mega.checkpoint.torch_dist import iter_torch_dist_hf_tensors
from verl_mega.run.checkpoints import STATE_FILE, complete_checkpoints
from verl_mega.run.folder import CONFIG_FILE, RunFolder, checkpoint_step, layout_name

from .mcore_to_hf import convert_mcore_to_hf, write_hf_model


def export_role(ckpt: str | Path, out: str | Path, *, role: str = "actor", step: int | None = None,
                family_spec: str | None = None, **options) -> Path:
    """Write `role`'s weights from `ckpt` (any of the forms above) as an HF folder; returns what was read.
    `family_spec` replaces the family spec the manifest records."""
    ckpt = Path(ckpt)
    weights = _final_weights(ckpt, role) if step is None else None
    if weights is not None:
        held = Manifest.read(weights, family_spec).role
        if held != role:
            raise ValueError(f"{weights} holds the {held}'s weights, not the {role}'s: pass --role {held}, or the "
                             f"{role}'s checkpoint (a run folder's {RunFolder(ckpt).final_weights(role).name})")
        convert_mcore_to_hf(weights, out, family_spec=family_spec, **options)
        return weights
    state_dir = _training_state_dir(ckpt, role, step)
    source = _starting_checkpoint(state_dir.parent, role)
    started = Manifest.read(source, family_spec)
    manifest = replace(started, format="torch_dist", role=role, tied_embeddings=started.tied_embeddings and role == "actor")
    write_hf_model(iter_torch_dist_hf_tensors(state_dir, manifest), manifest, source / HF_ASSETS_DIR, out,
                   sources=(state_dir, source), **options)
    return state_dir


def _final_weights(ckpt: Path, role: str) -> Path | None:
    if (ckpt / MANIFEST_NAME).is_file():
        return ckpt
    final = RunFolder(ckpt).final_weights(role)
    if (final / MANIFEST_NAME).is_file():
        return final
    return None


def _training_state_dir(ckpt: Path, role: str, step: int | None) -> Path:
    """The role's folder of a step checkpoint, from a run folder and --step, a step folder, or the role folder."""
    run = RunFolder(ckpt)
    final = run.final_weights(role).name
    if step is not None:
        if type(step) is not int or step < 0:
            raise ValueError(f"--step must be a step number, got {step!r}")
        step_folder = run.step(step)
        if not (step_folder / STATE_FILE).is_file():
            raise ValueError(f"{ckpt} has no complete checkpoint of step {step}; {_available_steps(ckpt)}")
    elif (ckpt / STATE_FILE).is_file():
        step_folder = ckpt
    elif (ckpt.parent / STATE_FILE).is_file():
        if ckpt.name != role:
            raise ValueError(f"{ckpt} holds the {ckpt.name}'s training state, not the {role}'s: pass --role {ckpt.name}")
        step_folder = ckpt.parent
    elif run.checkpoints.is_dir():
        raise ValueError(f"{ckpt} has no {final} (the run did not finish, or trained no {role}); "
                         f"export one of its step checkpoints with --step N: {_available_steps(ckpt)}")
    else:
        raise FileNotFoundError(f"{ckpt} is not a verl_mega checkpoint, run folder or step checkpoint (it has no "
                                f"{MANIFEST_NAME}, {final}/ or {STATE_FILE})")
    if not (step_folder / role).is_dir():
        raise ValueError(f"{step_folder} holds no {role} (the run trained without one)")
    return step_folder / role


def _available_steps(run_dir: Path) -> str:
    steps = [checkpoint_step(path) for path in complete_checkpoints(run_dir)]
    return f"its complete steps: {', '.join(map(str, steps))}" if steps else "it has no complete step checkpoints"


def _starting_checkpoint(step_folder: Path, role: str) -> Path:
    """The converted checkpoint `role` started from: model.<role>_ckpt, else the run's own conversion for the
    role (a critic's from model.critic_hf_path), else the actor's (model.actor_ckpt or the run's)."""
    config_file = step_folder / CONFIG_FILE
    try:
        config = yaml.safe_load(config_file.read_text())
        model, parallel = config["model"], config["parallel"]
        named, actor_named = model.get(f"{role}_ckpt") or "", model.get("actor_ckpt") or ""
        layout = layout_name(parallel["tp"], parallel["pp"], parallel["ep"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{config_file} is missing or unreadable ({err}): the step's model is unknown") from None
    run = RunFolder(step_folder.parent.parent)
    own = run.initial_weights(role, layout)
    if named or own.is_dir():
        candidate = Path(named) if named else own
    else:
        candidate = Path(actor_named) if actor_named else run.initial_weights("actor", layout)
    if not (candidate / MANIFEST_NAME).is_file():
        raise FileNotFoundError(f"the checkpoint the {role} of {step_folder} started from, {candidate}, is gone: "
                                "it holds the model's config and tokenizer files the export needs")
    return candidate
