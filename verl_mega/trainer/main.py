"""`verl-mega train --config FILE.yaml [key.sub=value ...]`, run under torchrun (or Slurm's srun + torchrun).

The config's `job` picks the loop: ppo (default), sft or dpo; `verl-mega sft` and `verl-mega dpo` are `train`
with the job set.

The config is validated before any process group starts; the resolved config is saved in the run folder.
A plain process (no torchrun) trains as a world of one.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch.distributed as dist

from verl_mega.checkpoint.atomic import atomic_write_text
from verl_mega.checkpoint.run_checkpoints import model_fingerprint
from verl_mega.config import load_config, to_yaml
from verl_mega.config.errors import USER_ERROR_EXIT_CODE, UserError, report_to_launcher
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.models import HFModelConfig
from verl_mega.parallel.state import destroy_parallel, init_parallel

from .ppo import PPOTrainer
from .preemption import StopRequest, requeue_slurm_job
from .run_folder import INITIAL_ACTOR_PREFIX, claim_run_folder
from .preference import PreferenceTrainer
from .sft import SFTTrainer
from .validation import validate

OFFLINE_JOBS = {"sft": SFTTrainer, "dpo": PreferenceTrainer}


def main(argv: list[str] | None = None, job: str | None = None) -> int:
    """`job`: run that job whatever the config names (`verl-mega sft` / `verl-mega dpo`)."""
    command = f"verl-mega {job or 'train'}"
    parser = argparse.ArgumentParser(prog=command)
    parser.add_argument("--config", help="YAML file (examples/ holds some)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=20")
    args = parser.parse_args(argv)

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    try:
        config = load_config(args.config, [*args.overrides, *([f"job={job}"] if job else [])])
        validate(config, world_size)
        train(config)
    except UserError as err:  # anything else is a bug and keeps its traceback
        print(f"{command}: error: {err}", file=sys.stderr)
        report_to_launcher(str(err))
        return USER_ERROR_EXIT_CODE
    return 0


def sft_main(argv: list[str] | None = None) -> int:
    return main(argv, job="sft")


def dpo_main(argv: list[str] | None = None) -> int:
    return main(argv, job="dpo")


def train(config) -> None:
    p = config.parallel
    layout = init_parallel(p.tp, p.pp, p.ep, seed=config.trainer.seed)
    run_dir = Path(config.trainer.run_dir)
    # Before anything is written: a folder of a live run or of another model is refused untouched.
    lock = claim_run_folder(run_dir, model_fingerprint(HFModelConfig.read_raw(config.model.hf_path)), layout.rank,
                            config.model.family_spec or None)
    if layout.rank == 0:
        atomic_write_text(run_dir / "config.yaml", to_yaml(config))
    actor_ckpt = prepare_checkpoint(config, layout, run_dir)
    stop = StopRequest().install()
    if config.job == "ppo":
        critic_ckpt = Path(config.model.critic_ckpt) if config.model.critic_ckpt else None
        job = PPOTrainer(config, layout, actor_ckpt, critic_ckpt, stop_requested=stop)
    else:
        job = OFFLINE_JOBS[config.job](config, layout, actor_ckpt, stop_requested=stop)
    finished = job.fit()
    job.close()
    if not finished and layout.rank == 0:
        requeue_slurm_job()
    destroy_parallel()
    if lock is not None:
        lock.release()


def prepare_checkpoint(config, layout, run_dir: Path) -> Path:
    """The actor's converted checkpoint: given, or converted from the HF model by rank 0 once per layout."""
    if config.model.actor_ckpt:
        return Path(config.model.actor_ckpt)
    p = config.parallel
    # One conversion per layout: a run resumed at another layout needs its initial (reference) weights there.
    # (claim_run_folder has checked that an existing one is of this model.)
    ckpt = run_dir / f"{INITIAL_ACTOR_PREFIX}tp{p.tp}_pp{p.pp}_ep{p.ep}"
    if not ckpt.exists() and layout.rank == 0:
        convert_hf_to_mcore(config.model.hf_path, ckpt, tp=p.tp, pp=p.pp, ep=p.ep, dtype=config.model.dtype,
                            family_spec=config.model.family_spec or None)
    dist.barrier()
    return ckpt


if __name__ == "__main__":
    sys.exit(main())
