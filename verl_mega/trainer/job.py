"""What every training job (RL, SFT, preference) shares around its step: the run folder, the step loop with
preemption, validation passes, profiled steps, step checkpoints and resume (and their mirror in object
storage), metrics, the health endpoint and the final weights for export.

The base class owns the order of construction: `__init__` runs the subclass's `build()` (its roles, data and
engines), then `start()` (resume, metrics log, health endpoint, mirror). A subclass never calls `start()`; it
implements `build()` and `train_step()` and names what it saves.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from verl_mega.config import TrainConfig, to_yaml
from verl_mega.config.errors import NonFiniteError, UserError
from verl_mega.files.atomic import atomic_file
from verl_mega.files.plain_state import count
from verl_mega.models import load_hf_model_config
from verl_mega.parallel.agree import all_finite, any_rank
from verl_mega.parallel.layout import ParallelLayout
from verl_mega.run import checkpoints as run_checkpoints
from verl_mega.run import mirror
from verl_mega.run.folder import RunFolder, checkpoint_step
from verl_mega.run.role_weights import save_role_weights

from .health import HealthServer
from .metrics import MetricsLogger, PeakMemory, print_note
from .progress import Progress


class TrainingJob:
    name = "train"  # the progress bar's label
    # Whether a fresh run validates before its first step too (logged as step 0): the baseline the curve
    # starts from. The offline jobs' first validation is after their first step.
    validates_before_training = False

    def __init__(self, config: TrainConfig, layout: ParallelLayout, stop_requested=lambda: False,
                 base_checksums: dict[str, str] | None = None, progress: Progress | None = None, **inputs):
        """`stop_requested()`: whether a signal asked this rank to save and stop (preemption). `base_checksums`:
        role -> sha256 of its HF folder, recorded in checkpoints (a LoRA role resumes on that base only).
        `progress`: the lines a person watching sees (none by default). `inputs`: what the job's `build` takes
        (the checkpoints its roles start from, ...)."""
        self.config, self.layout = config, layout
        self.progress = progress or Progress(enabled=False)
        self.base_checksums = base_checksums
        self.run_dir = Path(config.trainer.run_dir)
        self.hf_config, self.family = load_hf_model_config(config.model.hf_path, config.model.family_spec or None)
        self.fingerprint = run_checkpoints.model_fingerprint(self.hf_config.raw)
        self.stop_requested = stop_requested
        self.step = 0
        self.nonfinite_skipped = 0  # batches and optimizer steps dropped under trainer.nonfinite=skip
        self.logger = self.health = None
        self.mirror = None  # rank 0's checkpoint uploader when trainer.checkpoint_mirror is set
        self.build(**inputs)
        self.start()

    def start(self) -> None:
        """Resume from the run folder (or the checkpoint mirror), then open the metrics log, the health endpoint
        and the mirror's uploader. Runs once, after `build()`."""
        trainer = self.config.trainer
        if trainer.checkpoint_mirror:
            self._fetch_from_mirror()
        self.resume()
        if trainer.checkpoint_mirror and self.layout.rank == 0:
            self.mirror = mirror.CheckpointMirror(mirror.parse_mirror_url(trainer.checkpoint_mirror), self.run_dir,
                                                  trainer.keep_last)
        self.logger = MetricsLogger(self.run_dir, enabled=self.layout.rank == 0, tensorboard=trainer.tensorboard,
                                    wandb_project=trainer.wandb_project, log_format=trainer.log_format)
        try:
            self.health = (HealthServer(trainer.health_port) if self.layout.rank == 0 and trainer.health_port > 0
                           else None)
        except OSError as err:
            raise UserError(f"trainer.health_port={trainer.health_port}: cannot listen there ({err}); pick a free "
                            "port") from None
        self._set_health("ready")

    # --- what a job defines ---------------------------------------------------------------------------

    def build(self, **inputs) -> None:
        """Build the job's roles, data and engines from `inputs`; `start()` follows (it resumes into them)."""
        raise NotImplementedError

    def train_step(self) -> dict[str, float]:
        raise NotImplementedError

    def trainables(self) -> dict:
        """name -> TrainableModel saved in step checkpoints."""
        raise NotImplementedError

    def final_weights(self) -> list[tuple]:
        """(model, source checkpoint, role) of each role published for `verl-mega export`."""
        raise NotImplementedError

    def job_state(self) -> dict:
        """The job's own resumable state (sampler position, controllers), JSON-serialisable."""
        raise NotImplementedError

    def load_job_state(self, state: dict) -> None:
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        """Metrics on data.val_files (logged under `val/`); {} when the job has nothing to validate on.
        Collective: every rank calls it at the same steps. Its lines: `self.progress.phase` and `.batches`."""
        return {}

    def close(self) -> None:
        """Release what the job holds beyond the process group (engines, servers)."""

    # --- the loop -------------------------------------------------------------------------------------

    def fit(self) -> bool:
        """Train to `trainer.total_steps`; returns False if a stop was requested and the run saved early."""
        trainer = self.config.trainer
        progress = _progress(trainer.total_steps, self.step, self.progress.bar, self.name)
        stopped = False
        if self.step == 0 and self.validates_before_training:
            baseline = self._validation()
            if baseline:
                self.logger.log(0, baseline)
        first = self.step + 1  # this process's first step: the lines of its phases, and the heartbeat until then
        while self.step < trainer.total_steps and not stopped:
            self._set_health("training")
            with (self._profiled(self.step + 1), PeakMemory(self.measures_memory) as memory,
                  self.progress.phase(f"step {first}, the first of this run") if self.step + 1 == first
                  else contextlib.nullcontext()):
                metrics = self.train_step()
            metrics.update(memory.metrics())
            self.step += 1
            if (trainer.val_every > 0 and self.step % trainer.val_every == 0) or self.step == trainer.total_steps:
                metrics.update(self._validation())
            self.logger.log(self.step, metrics)
            self.progress.stop_heartbeat()
            progress.update(1)
            stopped = self._any_rank_asked_to_stop()
            due = trainer.save_every > 0 and self.step % trainer.save_every == 0
            if stopped or due or self.step == trainer.total_steps:
                self.save()
        progress.close()
        self.logger.close()
        if not stopped:
            self._set_health("saving")
            self._check_weights_finite("the final model")
            for model, source_ckpt, role in self.final_weights():
                save_role_weights(model, source_ckpt, RunFolder(self.run_dir).final_weights(role), self.layout,
                                  self.step, role=role)
        if self.mirror is not None:
            self.mirror.finish(trainer.checkpoint_mirror_wait_s)
        self._set_health("ready")
        if self.health is not None:
            self.health.close()
        return not stopped

    @property
    def measures_memory(self) -> bool:
        """trainer.memory_metrics; null: where it costs nothing (a GPU's allocator statistics)."""
        setting = self.config.trainer.memory_metrics
        return torch.cuda.is_available() if setting is None else setting

    def _validation(self) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.validate()
        if not metrics:
            return {}
        return {**{f"val/{name}": value for name, value in metrics.items()},
                "val/seconds": time.perf_counter() - start}

    @contextlib.contextmanager
    def _profiled(self, step: int):
        """torch.profiler over the step if trainer.profile_steps and profile_ranks name it and this rank; the
        trace is written whole, as Chrome trace JSON."""
        trainer = self.config.trainer
        if step not in trainer.profile_steps or self.layout.rank not in trainer.profile_ranks:
            yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities, record_shapes=True) as profiler:
            yield
        with atomic_file(RunFolder(self.run_dir).profile_trace(step, self.layout.rank)) as partial:
            profiler.export_chrome_trace(str(partial))

    def _set_health(self, status: str) -> None:
        if self.health is not None:
            self.health.set(status, self.step)

    def _any_rank_asked_to_stop(self) -> bool:
        return any_rank(self.stop_requested())

    def _check_weights_finite(self, what: str) -> None:
        for model, _, role in self.final_weights():
            if not all_finite(p for p in model.parameters()):
                raise NonFiniteError(f"step {self.step}: the {role}'s weights are NaN/inf; {what} of them is not "
                                     "written")

    # --- checkpoints ----------------------------------------------------------------------------------

    def save(self) -> Path:
        self._set_health("saving")
        self._check_weights_finite("a checkpoint")
        state = {"step": self.step, "nonfinite_skipped": self.nonfinite_skipped,
                 "model_fingerprint": self.fingerprint, "world_size": self.layout.world_size,
                 "layout": {"tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp}, **self.job_state()}
        saved = run_checkpoints.save_checkpoint(self.run_dir, self.step, trainables=self.trainables(),
                                                trainer_state=state, config_yaml=to_yaml(self.config),
                                                rank=self.layout.rank, keep_last=self.config.trainer.keep_last,
                                                base_checksums=self.base_checksums)
        if self.mirror is not None:
            self.mirror.submit(saved)
        return saved

    def _fetch_from_mirror(self) -> None:
        """Collective: rank 0 downloads the mirror's newest complete checkpoint when the run folder has none
        or an older one, then every rank resumes from the run folder as usual. The ranks wait by agreeing every
        half second, so a download may take longer than the process group's timeout."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            download = pool.submit(self._download_newer_checkpoint) if self.layout.rank == 0 else None
            while any_rank(download is not None and not download.done()):
                time.sleep(0.5)
            if download is not None:
                download.result()  # re-raises the download's error on rank 0

    def _download_newer_checkpoint(self) -> None:
        location = mirror.parse_mirror_url(self.config.trainer.checkpoint_mirror)
        local = run_checkpoints.complete_checkpoints(self.run_dir)
        newest_local = checkpoint_step(local[-1]) if local else -1
        fetched = mirror.fetch_newer(mirror.connect(location), location, self.run_dir, newest_local)
        if fetched is not None:
            print_note(f"fetched {fetched.name} from the checkpoint mirror {location}", self.config.trainer.log_format)

    def resume(self) -> None:
        """Continue from the newest complete checkpoint of the run folder, if there is one."""
        found = run_checkpoints.complete_checkpoints(self.run_dir)
        if not found:
            if self.layout.rank == 0:  # a fresh start: what an attempt killed before its first checkpoint logged
                MetricsLogger.truncate(self.run_dir, -1)
            return
        run_checkpoints.load_checkpoint(found[-1], trainables=self.trainables(), fingerprint=self.fingerprint,
                                        rank=self.layout.rank, world_size=self.layout.world_size,
                                        base_checksums=self.base_checksums, restore_job_state=self._restore_state)
        if self.layout.rank == 0:
            print_note(f"resumed from {found[-1]} at step {self.step}", self.config.trainer.log_format)
            MetricsLogger.truncate(self.run_dir, self.step)


    def _restore_state(self, state: dict) -> None:
        """The step, the skip count and the job's own state from a checkpoint's trainer state, before its weights
        are read; every value is checked before any is taken (a ValueError naming the key)."""
        skipped = count(state, "nonfinite_skipped", "") if "nonfinite_skipped" in state else 0  # older: none
        self.load_job_state(state)
        self.step, self.nonfinite_skipped = state["step"], skipped


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, initial: int, enabled: bool, name: str):
    if not enabled:
        return _NoProgress()
    return tqdm(total=total, initial=initial, desc=name, unit="step", leave=False)
