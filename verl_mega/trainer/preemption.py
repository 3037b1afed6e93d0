"""Preemption: Slurm's warning signal (SIGUSR1, `--signal` in the sbatch script) or SIGTERM asks the trainer
to finish its step, save, and stop; under Slurm rank 0 then requeues the job, which resumes by itself."""
from __future__ import annotations

import os
import signal
import subprocess

from .metrics import print_note

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """Callable flag set by the stop signals; the trainer checks it between steps."""

    def __init__(self):
        self.received: int | None = None

    def install(self) -> "StopRequest":
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __call__(self) -> bool:
        return self.received is not None


def requeue_slurm_job(log_format: str) -> bool:
    """`scontrol requeue` this job when running under Slurm; Slurm ends the job's processes right after."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    print_note(f"requeueing Slurm job {job} after saving", log_format)
    # Its exit status is not checked: the requeue ends this very process group, scontrol included.
    subprocess.run(["scontrol", "requeue", job], check=False)
    return True
