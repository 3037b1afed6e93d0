"""Test payload acting out the trainer's side of the requeue protocol (templates/sbatch.sh).

First run: every rank reports ready and waits for the warning signal; on it each rank writes a "saved"
marker, and rank 0, once every rank has saved (requeueing ends the job at once), runs
`scontrol requeue $SLURM_JOB_ID`. Second run (the requeue marker exists): every rank records that it
ran again and exits 0.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

WAIT_SECONDS = 90


def wait_until(condition, failure: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"{failure} within {WAIT_SECONDS} s")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    requeued_marker = out / "requeued"
    if requeued_marker.exists():
        (out / f"second-run-rank{rank}").write_text(os.environ.get("SLURM_RESTART_COUNT", ""))
        return

    received: list[str] = []
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: received.append(signal.Signals(signum).name))
    (out / f"ready-rank{rank}").touch()
    wait_until(lambda: received, f"rank {rank}: no warning signal")
    (out / f"saved-rank{rank}").write_text(received[0])
    if rank == 0:
        world_size = int(os.environ["WORLD_SIZE"])
        wait_until(lambda: all((out / f"saved-rank{other}").exists() for other in range(world_size)),
                   "rank 0: not every rank saved")
        requeued_marker.touch()
        # The requeue terminates the whole job, this scontrol included, so its exit status tells nothing;
        # the test checks the job's restart count instead.
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]])


if __name__ == "__main__":
    main()
