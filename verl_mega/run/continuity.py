"""Whether a run folder may be continued with this config: a resumed run trains what it started training.

A run folder's `config.yaml` holds the config its run started with. Starting again on that folder resumes it, so
a config that differs in what is trained (data files, algorithm, batch sizes, model, optimizer) would silently
continue another run under the first one's name; such a start is refused naming the keys that differ, unless
`trainer.allow_config_change` says to go on. What may differ freely is the run's length, its logging and
observability, where it keeps things (run folder, mirror, conversion cache) and how it is laid out on the
machine (parallel layout, micro-batching), which changes no math beyond reordering sums (resume at another
layout is a feature).
"""
from __future__ import annotations

from pathlib import Path

from verl_mega.config import TrainConfig, load_config, to_dict
from verl_mega.config.errors import UserError

# Keys (or sections, ending in '.') a resumed run may change.
MAY_CHANGE = (
    "parallel.", "trainer.total_steps", "trainer.save_every", "trainer.keep_last", "trainer.run_dir",
    "trainer.checkpoint_mirror", "trainer.checkpoint_mirror_wait_s", "trainer.tensorboard", "trainer.wandb_project",
    "trainer.health_port", "trainer.progress_bar", "trainer.val_every", "trainer.log_format",
    "trainer.log_samples_every", "trainer.log_samples", "trainer.profile_steps", "trainer.profile_ranks",
    "trainer.allow_config_change", "model.conversion_cache", "actor.micro_batch_size", "critic.micro_batch_size",
    "actor.max_tokens_per_micro_batch", "critic.max_tokens_per_micro_batch",
)
# Filled in from the conversion cache when the run started (the saved config names them); empty now means the same.
FILLED_IN_AT_START = ("model.actor_ckpt", "model.critic_ckpt")


def config_changes(saved: TrainConfig, config: TrainConfig) -> list[str]:
    """The dotted keys whose values differ between the saved config and this one, beyond what MAY_CHANGE."""
    before, after = _flat(to_dict(saved)), _flat(to_dict(config))
    changed = []
    for key in sorted(before.keys() | after.keys()):
        if before.get(key) == after.get(key) or any(key == k or (k.endswith(".") and key.startswith(k))
                                                    for k in MAY_CHANGE):
            continue
        if key in FILLED_IN_AT_START and not after.get(key):
            continue
        changed.append(key)
    return changed


def check_continuation(saved_config: Path, config: TrainConfig) -> None:
    """Refuse, naming the keys, a config that would continue the run saved at `saved_config` as another run."""
    try:
        saved = load_config(saved_config)
    except UserError as err:
        raise UserError(f"{saved_config} cannot be read back ({err}); it belongs to the run being resumed: restore "
                        "it, or point trainer.run_dir at a new folder") from None
    changed = config_changes(saved, config)
    if changed and not config.trainer.allow_config_change:
        before, after = _flat(to_dict(saved)), _flat(to_dict(config))
        shown = "; ".join(f"{key}: {before.get(key)!r} -> {after.get(key)!r}" for key in changed[:4])
        more = f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""
        raise UserError(f"{config.trainer.run_dir} holds a run started with another config ({shown}{more}); "
                        "resuming would continue that run: point trainer.run_dir at a new folder, or set "
                        "trainer.allow_config_change=true to continue it with these changes")


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
