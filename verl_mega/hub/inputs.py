"""A run's Hub inputs replaced by their local snapshots, before the pre-flight check reads them.

The keys naming a model folder that the run reads (`trainer.rl.needs.model_keys`: model.hf_path, the critic's,
the reward model's and the distillation teachers') may name a Hub model (`org/name[@revision]`; the reference
follows the actor); a key the run does not read is left as it is, so nothing it names is downloaded.
data.train_files and data.val_files may hold `hf://datasets/...` entries, each replaced by the files it names.
The launcher does it once per node before the ranks start (so they find the cache warm), and every rank does it
again at start-up (no download then: the node lock makes the others wait for the first). The snapshot paths
say where they came from (`hub_origin`), which the provenance records.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

from verl_mega.config import TrainConfig

from .refs import dataset_ref, model_ref
from .resolve import HubError, resolve_dataset, resolve_model

DATA_KEYS = ("train_files", "val_files")


def resolve_inputs(config: TrainConfig, model_keys: Iterable[tuple[str, ...]], *,
                   model_configs_only: bool = False) -> TrainConfig:
    """Rewrite `config`'s Hub ids in place into local paths (and return it); raises HubError naming the key.
    `model_keys`: the paths of the keys naming the models the run reads, ("model", "hf_path") or ("teacher",
    "by_data_source", SOURCE). `model_configs_only`: the models' config.json alone and no data (`verl-mega plan
    --memory`)."""
    for path in model_keys:
        *parents, key = path
        holder = functools.reduce(_child, parents, config)
        value = _child(holder, key)
        ref = model_ref(value) if value else None
        if ref is not None:
            resolved = _named(".".join(path), lambda ref: resolve_model(ref, weights=not model_configs_only), ref)
            if isinstance(holder, Mapping):
                holder[key] = str(resolved.path)
            else:
                setattr(holder, key, str(resolved.path))
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


def _child(holder, key: str):
    return holder[key] if isinstance(holder, Mapping) else getattr(holder, key)


def _named(key: str, resolve, ref):
    try:
        return resolve(ref)
    except HubError as err:
        raise HubError(f"{key}: {err}") from None
