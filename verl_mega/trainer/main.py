"""`verl-mega train --config FILE.yaml [key.sub=value ...]`, run under torchrun (or Slurm's srun + torchrun).

The config's `job` picks the loop: rl (default), sft or preference; `verl-mega sft` and `verl-mega preference`
(or its old name `verl-mega dpo`) are `train` with the job set.

Hub ids in the config (models `org/name[@rev]`, data `hf://datasets/...`) are resolved to their snapshots in the
cache first (verl_mega.hub; one process per node downloads). The config passes the pre-flight check before any
process group starts; the resolved config and the run's
provenance are saved in the run folder. A plain process (no torchrun) trains as a world of one. `run` is the one
way in for the command line and the Python API (`verl_mega.api`), which may hand a reward function itself.
"""
from __future__ import annotations

import argparse
import hashlib
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from verl_mega.checkpoint.hf_assets import model_sha256
from verl_mega.checkpoint.manifest import MANIFEST_NAME
from verl_mega.config import load_config, to_yaml
from verl_mega.config.errors import USER_ERROR_EXIT_CODE, UserError, report_to_launcher
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.files.atomic import atomic_write_text
from verl_mega.hub import resolve_inputs
from verl_mega.models import HFModelConfig
from verl_mega.parallel.process_exit import exit_process
from verl_mega.parallel.state import destroy_parallel, init_parallel
from verl_mega.run.checkpoints import complete_checkpoints, model_fingerprint
from verl_mega.run.continuity import check_continuation
from verl_mega.run.folder import RunFolder, checkpoint_step, layout_name
from verl_mega.run.lock import claim_run_folder
from verl_mega.run.provenance import write_provenance
from verl_mega.parallel.bridge import PeerFailed, init_placement
from verl_mega.parallel.placement import placement_for
from verl_mega.parallel.world import read_world

from .metrics import print_note
from .preemption import StopRequest, requeue_slurm_job, slurm_job, stop_line
from .preference import PreferenceJob
from .preflight import preflight_check
from .progress import Progress
from .quantized_rollout import tis_note, with_quantization_tis
from .rl import RLJob
from .rl.needs import TEACHER_OF, model_keys, role_layout, teacher_folders, uses_critic
from .rl.rollout_service import RolloutService
from .sft import SFTJob

PEER_FAILED_EXIT_CODE = 3  # a rank of the other role (disaggregated placement) died or hung
STOPPED_AT_ONCE_EXIT_CODE = 128 + 2  # as a shell reports a process that SIGINT ended
OFFLINE_JOBS = {"sft": SFTJob, "preference": PreferenceJob}


def main(argv: list[str] | None = None, job: str | None = None) -> int:
    """`job`: run that job whatever the config names (`verl-mega sft` / `verl-mega preference`)."""
    command = f"verl-mega {job or 'train'}"
    parser = argparse.ArgumentParser(prog=command)
    parser.add_argument("--config", help="YAML file (examples/ holds some)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=20")
    args = parser.parse_args(argv)

    try:
        run(load_config(args.config, [*args.overrides, *([f"job={job}"] if job else [])]))
    except UserError as err:  # anything else is a bug and keeps its traceback
        print(f"{command}: error: {err}", file=sys.stderr)
        report_to_launcher(str(err))
        return USER_ERROR_EXIT_CODE
    except PeerFailed as err:  # the other role's rank, named; this one's state needs no traceback
        print(f"{command}: error: {err}", file=sys.stderr)
        return PEER_FAILED_EXIT_CODE
    except KeyboardInterrupt:  # a second Ctrl-C (the first one stops after the step, saved)
        print(f"{command}: stopped at once by a second Ctrl-C; the newest checkpoint is the last one saved",
              file=sys.stderr)
        return STOPPED_AT_ONCE_EXIT_CODE
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # all is saved: what is left of the exit has nothing to stop
    return 0


def sft_main(argv: list[str] | None = None) -> int:
    return main(argv, job="sft")


def preference_main(argv: list[str] | None = None) -> int:
    return main(argv, job="preference")


def run(config, reward_fn=None) -> None:
    """Validate `config` for this job's world size, then train. `reward_fn`: a callable scoring responses in
    place of `reward.function` (the RL job only)."""
    preflight_check(resolve_inputs(config, model_keys(config)), read_world().size, reward_fn=reward_fn)
    note = tis_note(config)
    if note and read_world().rank == 0:
        print_note(note, config.trainer.log_format)
    train(config, reward_fn)


def train(config, reward_fn=None) -> None:
    p = config.parallel
    bridge = placement = None
    if p.rollout_ranks:  # disaggregated: each rank to its role, the rollout ranks to their loop
        world = read_world()
        placement = placement_for(world.rank, world.size, p.rollout_ranks, p.rollout_tp, p.tp)
        bridge = init_placement(placement, bridge_timeout_s=p.bridge_timeout_s)
        if placement.role == "rollout":
            try:
                RolloutService(config, bridge, placement).serve()
            finally:
                bridge.close()
                destroy_parallel()
            return
    layout = init_parallel(p.tp, p.pp, p.ep, seed=config.trainer.seed, cp=p.cp, vpp=p.vpp)
    run_dir = Path(config.trainer.run_dir)
    stop = StopRequest(announce=layout.rank == 0)  # installed once the models are about to load
    # The lock and the process group are released on an error too, so that a script (the Python API) may fix
    # its mistake and train again in the same process.
    try:
        # Before anything is written: a folder of a live run or of another model is refused untouched.
        lock = claim_run_folder(run_dir, model_fingerprint(HFModelConfig.read_raw(config.model.hf_path)),
                                layout.rank, config.model.family_spec or None)
        try:
            finished = _run_job(with_quantization_tis(config), layout, run_dir, stop, reward_fn, bridge, placement)
        finally:
            if lock is not None:
                lock.release()
    finally:
        if bridge is not None:
            bridge.close()
        destroy_parallel()
        # The process's own handlers (the Python API caller's) only now: a launcher's SIGTERM, sent as soon as
        # a peer rank died, must not kill this one while it tears down and before it has said why it failed.
        stop.restore()
    if not finished and layout.rank == 0:
        requeue_slurm_job()


def _run_job(config, layout, run_dir: Path, stop: StopRequest, reward_fn, bridge=None, placement=None) -> bool:
    progress = Progress(layout.rank == 0, config.trainer.log_format, config.trainer.progress_bar)
    progress.start_heartbeat()
    try:
        return _prepare_and_fit(config, layout, run_dir, stop, reward_fn, bridge, placement, progress)
    finally:
        progress.stop_heartbeat()


def _prepare_and_fit(config, layout, run_dir: Path, stop: StopRequest, reward_fn, bridge, placement,
                     progress: Progress) -> bool:
    # Read once per run, by rank 0: the weights' checksums, for the provenance record and the conversion cache.
    with progress.phase(f"reading the checksum of {config.model.hf_path}", lines=False):
        checksums = [model_checksums(config) if layout.rank == 0 else None]
    dist.broadcast_object_list(checksums, src=0)
    checksums = checksums[0]
    folder = RunFolder(run_dir)
    if folder.config.is_file() and complete_checkpoints(run_dir):  # a resume: of the run that folder holds
        check_continuation(folder.config, config)
    if config.model.sha256 and checksums["actor"] != config.model.sha256.lower():
        raise UserError(f"model.sha256: {config.model.hf_path} has sha256 {checksums['actor']}, not the expected "
                        f"{config.model.sha256}; point model.hf_path at the expected model or update model.sha256")
    # The converted checkpoint each role starts from: given, or converted from its HF folder.
    ckpts = {role: prepare_checkpoint(config, layout, run_dir, role, checksum, progress)
             for role, checksum in checksums.items()}
    if config.model.conversion_cache:
        # The saved config names conversions outside the run folder (`verl-mega export --step` reads it); those
        # inside are found by their names, wherever the run folder is moved.
        # (A data source's teacher is found again by its checksum.)
        for role, ckpt in ckpts.items():
            if not role.startswith(TEACHER_OF):
                setattr(*given_ckpt_key(config, role), str(ckpt))
    # Until here a stop signal stops at once (nothing to save); from here it asks for a saved stop (train()
    # gives the handlers back).
    stop.install()
    with progress.phase(f"loading the models from {ckpts['actor']}"):
        if config.job == "rl":
            critic_ckpt = ckpts.get("critic") or (Path(config.model.critic_ckpt) if config.model.critic_ckpt
                                                  else None)
            job = RLJob(config, layout, stop, checksums, progress, actor_ckpt=ckpts["actor"],
                        critic_ckpt=critic_ckpt, reward_fn=reward_fn, bridge=bridge, placement=placement,
                        teacher_ckpts=teacher_ckpts(config, ckpts))
        else:
            job = OFFLINE_JOBS[config.job](config, layout, stop, checksums, progress, actor_ckpt=ckpts["actor"])
    # Written once the job has been built and has resumed: a start refused on the way changes neither.
    if layout.rank == 0:
        atomic_write_text(folder.config, to_yaml(config))
        write_provenance(run_dir, config, checksums, reward_fn)
    finished = job.fit()
    job.close()
    if not finished and layout.rank == 0:
        saved = complete_checkpoints(run_dir)
        checkpoint = saved[-1] if saved and checkpoint_step(saved[-1]) == job.step else None
        print_note(stop_line(stop.received, job.step, config.trainer.total_steps, checkpoint, run_dir, slurm_job()),
                   config.trainer.log_format)
    return finished


def model_checksums(config) -> dict[str, str]:
    """role -> sha256 of the HF folder it starts from (the critic's when model.critic_hf_path names one that the
    job uses, the distillation teachers' (`rl.needs.teacher_folders`))."""
    checksums = {"actor": model_sha256(config.model.hf_path)}
    if config.model.critic_hf_path and uses_critic(config):
        checksums["critic"] = model_sha256(config.model.critic_hf_path)
    checksums.update({role: model_sha256(folder) for role, folder in teacher_folders(config).items()})
    return checksums


def teacher_ckpts(config, ckpts: dict[str, Path]) -> dict[str | None, Path]:
    """The distillation teachers' checkpoints by data source (None: the rows of every other source), from the
    converted `ckpts` by role and teacher.ckpt; empty without distillation."""
    found = {role.removeprefix(TEACHER_OF): ckpt for role, ckpt in ckpts.items() if role.startswith(TEACHER_OF)}
    default = ckpts.get("teacher") or (Path(config.teacher.ckpt) if config.teacher.ckpt else None)
    return {None: default, **found} if default is not None else found


def given_ckpt_key(config, role: str) -> tuple[object, str]:
    """(section, key) of the config naming `role`'s converted checkpoint: model.actor_ckpt, model.critic_ckpt or
    teacher.ckpt."""
    return (config.teacher, "ckpt") if role == "teacher" else (config.model, f"{role}_ckpt")


def prepare_checkpoint(config, layout, run_dir: Path, role: str, checksum: str, progress: Progress) -> Path:
    """`role`'s converted checkpoint: given (model.<role>_ckpt), or converted from its HF folder by rank 0 once
    per layout, into model.conversion_cache under the folder's `checksum` when set, else into the run folder."""
    given = "" if role.startswith(TEACHER_OF) else getattr(*given_ckpt_key(config, role))
    if given:
        return Path(given)
    hf_path = {"actor": config.model.hf_path, "critic": config.model.critic_hf_path, **teacher_folders(config)}[role]
    ckpt = conversion_path(config, run_dir, role, checksum)
    if layout.rank == 0 and ckpt.exists():
        if not (ckpt / MANIFEST_NAME).is_file():  # conversions are published whole, so this is someone else's
            raise UserError(f"{ckpt} exists but is no converted checkpoint (no {MANIFEST_NAME}); remove it")
        print_note(f"using the converted {role} checkpoint {ckpt}", config.trainer.log_format)
    elif layout.rank == 0:
        tp, pp, ep = role_layout(config, role)
        with progress.phase(f"converting the {role}'s {hf_path} into {ckpt}"):
            convert_hf_to_mcore(hf_path, ckpt, tp=tp, pp=pp, ep=ep, dtype=config.model.dtype,
                                family_spec=config.model.family_spec or None)
    dist.barrier()
    return ckpt


def conversion_path(config, run_dir: Path, role: str, checksum: str) -> Path:
    layout = layout_name(*role_layout(config, role))
    if not config.model.conversion_cache:
        # One conversion per layout: a run resumed at another layout needs its initial (reference) weights there.
        # (claim_run_folder has checked that an existing actor conversion is of this model.)
        folder = RunFolder(run_dir)
        if role.startswith("teacher"):  # the teacher's, or a data source's teacher's
            return folder.teacher_weights(layout, checksum)
        return folder.initial_weights(role, layout)
    # The same weights converted at the same layout and dtype (and by the same family spec) are the same shards.
    spec = config.model.family_spec
    variant = f"{layout}_{config.model.dtype}" + (f"_{hashlib.sha256(spec.encode()).hexdigest()[:12]}" if spec else "")
    return Path(config.model.conversion_cache) / checksum / variant


if __name__ == "__main__":
    exit_process(main())  # a rank: everything is written by now; skip freeing the interpreter's objects
