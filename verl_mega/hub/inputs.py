"""A run's Hub inputs replaced by their local snapshots, before the pre-flight check reads them.

model.hf_path, model.critic_hf_path, reward.reward_model and teacher.hf_path may name a Hub model
(`org/name[@revision]`; the reference follows the actor); data.train_files and data.val_files may hold `hf://datasets/...` entries, each
replaced by the files it names. The launcher does it once per node before the ranks start (so they find the
cache warm), and every rank does it again at start-up (no download then: the node lock makes the others wait
for the first). The snapshot paths say where they came from (`hub_origin`), which the provenance records.
"""
from __future__ import annotations

from verl_mega.config import TrainConfig

from .refs import dataset_ref, model_ref
from .resolve import HubError, resolve_dataset, resolve_model

MODEL_KEYS = (("model", "hf_path"), ("model", "critic_hf_path"), ("reward", "reward_model"),
              ("teacher", "hf_path"))
DATA_KEYS = ("train_files", "val_files")


def resolve_inputs(config: TrainConfig, *, model_configs_only: bool = False) -> TrainConfig:
    """Rewrite `config`'s Hub ids in place into local paths (and return it); raises HubError naming the key.
    `model_configs_only`: the models' config.json alone and no data (`verl-mega plan --memory`)."""
    for section, key in MODEL_KEYS:
        value = getattr(getattr(config, section), key)
        ref = model_ref(value) if value else None
        if ref is not None:
            resolved = _named(f"{section}.{key}", lambda ref: resolve_model(ref, weights=not model_configs_only), ref)
            setattr(getattr(config, section), key, str(resolved.path))
    if model_configs_only:
        return config
    for key in DATA_KEYS:
        files = []
        for value in getattr(config.data, key):
            try:
                ref = dataset_ref(value)
            except ValueError as err:
                raise HubError(f"data.{key}: {err}") from None
            if ref is None:
                files.append(value)
                continue
            resolved = _named(f"data.{key}", resolve_dataset, ref)
            files.extend(str(resolved.path / file) for file in resolved.files)
        setattr(config.data, key, files)
    return config


def _named(key: str, resolve, ref):
    try:
        return resolve(ref)
    except HubError as err:
        raise HubError(f"{key}: {err}") from None
