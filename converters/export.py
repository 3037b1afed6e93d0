"""What `verl-mega export --ckpt X [--step N] --role R` reads, and the export itself.

X may be a verl_mega checkpoint (converted, or a role's final weights), a run folder (its final weights, or
with --step N that step's), a step checkpoint (RUN/checkpoints/step_N) or a role's folder inside one. A step
checkpoint holds each role's training state, model and optimizer, as a megatron dist checkpoint: its model
weights are exported, the optimizer is not read; its files are first checked against the digests it recorded
(`run.checkpoint_digests`). The model's config, vocabulary and tokenizer files come from
the checkpoint the role started from (named in the step's config.yaml, or converted into the run folder).

A LoRA run's step checkpoint (`actor.lora.rank > 0` in its config.yaml) holds the adapters, not the base: it
is exported as a PEFT adapter folder (`lora_export`), or with `merge` the adapters merged into the base it
started from as a plain HF folder. (A LoRA run's final weights are written merged: they export as any model.)
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from verl_mega.checkpoint.manifest import HF_ASSETS_DIR, MANIFEST_NAME, Manifest
from verl_mega.checkpoint.torch_dist import iter_torch_dist_hf_tensors, read_adapter_tensors
from verl_mega.models import HFModelConfig, family_for
from verl_mega.run.checkpoint_digests import verify_digests
from verl_mega.run.checkpoints import STATE_FILE, complete_checkpoints
from verl_mega.run.folder import CONFIG_FILE, RunFolder, checkpoint_step, layout_name

from .lora_export import Adapters, hf_adapters, merged_hf_tensors, write_peft_folder
from .mcore_to_hf import convert_mcore_to_hf, iter_checkpoint_hf_tensors, write_hf_model


def export_role(ckpt: str | Path, out: str | Path, *, role: str = "actor", step: int | None = None,
                family_spec: str | None = None, merge: bool = False, **options) -> Path:
    """Write `role`'s weights from `ckpt` (any of the forms above) as an HF folder, or a LoRA step's adapters as a
    PEFT folder (`merge`: merged into the base, an HF folder); returns what was read. `family_spec` replaces the
    family spec the manifest records."""
    ckpt = Path(ckpt)
    weights = _final_weights(ckpt, role) if step is None else None
    if weights is not None:
        if merge:
            raise ValueError(f"--merge: {weights} holds whole weights, no adapters to merge (a LoRA run's final "
                             "weights are written merged): export without --merge")
        held = Manifest.read(weights, family_spec).role
        if held != role:
            raise ValueError(f"{weights} holds the {held}'s weights, not the {role}'s: pass --role {held}, or the "
                             f"{role}'s checkpoint (a run folder's {RunFolder(ckpt).final_weights(role).name})")
        convert_mcore_to_hf(weights, out, family_spec=family_spec, **options)
        return weights
    state_dir = _training_state_dir(ckpt, role, step)
    try:
        verify_digests(state_dir.parent)
    except ValueError as err:
        raise ValueError(f"{err}; export another of the run's step checkpoints (--step N)") from None
    config = _step_config(state_dir.parent)
    source = _starting_checkpoint(state_dir.parent, role, config)
    started = Manifest.read(source, family_spec)
    manifest = replace(started, format="torch_dist", role=role, tied_embeddings=started.tied_embeddings and role == "actor")
    lora = _lora_settings(config, role, state_dir.parent / CONFIG_FILE)
    if lora is None and merge:
        raise ValueError(f"--merge: {state_dir} holds no LoRA adapters (its run trained every parameter): export "
                         "without --merge")
    if lora is None:
        write_hf_model(iter_torch_dist_hf_tensors(state_dir, manifest), manifest, source / HF_ASSETS_DIR, out,
                       sources=(state_dir, source), **options)
        return state_dir
    if role != "actor":
        raise ValueError(f"{state_dir}: exporting a LoRA {role} is not supported (its value head trains in full "
                         "beside the adapters); export the actor, or train the critic without critic.lora")
    adapters = Adapters(*lora, read_adapter_tensors(state_dir, manifest))
    if merge:
        hf_config = HFModelConfig.from_dict(manifest.hf_config)
        family = family_for(hf_config, manifest.family_spec, recorded=True)
        deltas = {name: (a, b) for name, a, b in hf_adapters(adapters, hf_config, family)}
        merged = merged_hf_tensors(iter_checkpoint_hf_tensors(source, started), deltas, adapters.scale)
        write_hf_model(merged, manifest, source / HF_ASSETS_DIR, out, sources=(state_dir, source), **options)
    else:
        write_peft_folder(adapters, manifest, source / HF_ASSETS_DIR, out, base_model=str(config["model"].get("hf_path") or ""),
                          sources=(state_dir, source), dtype=options.get("dtype"), overwrite=options.get("overwrite", False))
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


def _step_config(step_folder: Path) -> dict:
    config_file = step_folder / CONFIG_FILE
    try:
        config = yaml.safe_load(config_file.read_text())
        if not isinstance(config, dict):
            raise TypeError("it holds no mapping")
    except (OSError, yaml.YAMLError, ValueError, TypeError) as err:  # ValueError: not UTF-8 text
        raise ValueError(f"{config_file} is missing or unreadable ({' '.join(str(err).split())}): the step's model "
                         "is unknown") from None
    return config


def _lora_settings(config: dict, role: str, config_file: Path) -> tuple[int, float, float] | None:
    """(rank, alpha, dropout) of `role`'s adapters from the step's config, or None: no adapters. alpha's default,
    2 x rank, is `models.lora.lora_scale`'s."""
    section = config.get(role)
    lora = section.get("lora") if isinstance(section, dict) else None
    if not isinstance(lora, dict) or not lora.get("rank"):
        return None
    rank, alpha, dropout = lora.get("rank"), lora.get("alpha"), lora.get("dropout", 0.0)
    alpha = 2.0 * rank if alpha is None and type(rank) is int else alpha
    if type(rank) is not int or rank < 1 or type(alpha) not in (int, float) or alpha <= 0 \
            or type(dropout) not in (int, float) or not 0 <= dropout < 1:
        raise ValueError(f"{config_file}: {role}.lora (rank {rank!r}, alpha {alpha!r}, dropout {dropout!r}) is not a "
                         "LoRA setting: rank a whole number >= 1, alpha > 0, dropout in [0, 1)")
    return rank, float(alpha), float(dropout)


def _starting_checkpoint(step_folder: Path, role: str, config: dict) -> Path:
    """The converted checkpoint `role` started from: model.<role>_ckpt, else the run's own conversion for the
    role (a critic's from model.critic_hf_path), else the actor's (model.actor_ckpt or the run's)."""
    config_file = step_folder / CONFIG_FILE
    try:
        model, parallel = config["model"], config["parallel"]
        named, actor_named = model.get(f"{role}_ckpt") or "", model.get("actor_ckpt") or ""
        layout = layout_name(parallel["tp"], parallel["pp"], parallel["ep"])
    except (KeyError, TypeError, AttributeError) as err:
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
