"""Stopping a run cleanly: Slurm's warning signal (SIGUSR1, `--signal` in the sbatch script), SIGTERM or Ctrl-C
(SIGINT) asks the trainer to finish its step, save, and stop; under Slurm rank 0 then requeues the job, which
resumes by itself. A second Ctrl-C stops at once, without saving.

The run ends with one line (`stop_line`) saying at which step it stopped, which checkpoint holds it, and the
commands that resume and export from it. The command that resumes is the one that started the run: the launchers
hand theirs to the ranks (`LAUNCH_COMMAND_ENV`); a plain process reads its own.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from verl_mega.parallel.spawn import LAUNCH_COMMAND_ENV

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
ONCE_MORE = b"Ctrl-C: stopping after this step and saving it (Ctrl-C again stops at once, without saving)\n"


class StopRequest:
    """Callable flag set by the stop signals; the trainer checks it between steps. `announce`: whether this
    process says on stderr that a first Ctrl-C was heard (rank 0)."""

    def __init__(self, announce: bool = False):
        self.received: int | None = None
        self.announce = announce
        self.previous: dict = {}

    def install(self) -> "StopRequest":
        self.previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        return self

    def restore(self) -> None:
        """The handlers from before `install`."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self.received == signal.SIGINT:  # the second Ctrl-C: now
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            if self.announce:
                os.write(2, ONCE_MORE)  # not print: a handler may run in the middle of a print
        self.received = self.received or signum

    def __call__(self) -> bool:
        return self.received is not None


def started_by() -> str:
    """The command line that started this run, as a user would type it again."""
    given = os.environ.get(LAUNCH_COMMAND_ENV)
    if given:
        return given
    if Path(sys.argv[0]).name == "verl-mega":
        return shlex.join(["verl-mega", *sys.argv[1:]])
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun of the user's own: its command line is not ours to see
        return "the torchrun command that started it"
    return shlex.join(sys.orig_argv)


def stop_line(signum: int | None, step: int, total_steps: int, checkpoint: Path | None, run_dir: Path,
              slurm_job: str | None) -> str:
    """The one line a stopped run ends with: where it stopped, what holds it, how to go on from there."""
    name = signal.Signals(signum).name if signum else "a signal"
    if checkpoint is None:
        return f"stopped by {name} at step {step} of {total_steps}; no checkpoint was saved"
    resume = (f"Slurm requeues job {slurm_job}, which resumes from it by itself" if slurm_job
              else f"run {started_by()} again")
    export = shlex.join(["verl-mega", "export", "--ckpt", str(run_dir), "--step", str(step), "--out", "OUT_DIR"])
    return (f"stopped by {name} at step {step} of {total_steps}: checkpoint {checkpoint} holds it; to resume, "
            f"{resume}; to export it, {export}")


def slurm_job() -> str | None:
    return os.environ.get("SLURM_JOB_ID")


def requeue_slurm_job() -> None:
    """`scontrol requeue` this job when running under Slurm; Slurm ends the job's processes right after."""
    job = slurm_job()
    if job:
        # Its exit status is not checked: the requeue ends this very process group, scontrol included.
        subprocess.run(["scontrol", "requeue", job], check=False)
