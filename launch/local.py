"""`verl-mega launch local`: run the payload under torchrun on this machine (no scheduler).

The trainer on one rank (`--nproc 1`, no rollout ranks, no `--env`) runs in this process instead: a torchrun
agent would add a second and a third interpreter (the agent importing torch, the rank importing again all that
this launcher has imported for its pre-flight check) around the same one rank: 9.8-11.1 CPU-s for a 2-step run
of the tiny model on one thread, 4.8-6.0 CPU-s in this process (docs/benchmarks.md). The rank sees what
torchrun would give it: a world of one on a free local port (whatever Slurm or MASTER_* variables the
launcher's own environment holds), one thread unless OMP_NUM_THREADS says otherwise, and no working folder on
its import path. `--env` asks for variables set before the rank's interpreter starts (thread pools, allocators
read them at import), so it keeps the torchrun agent.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from contextlib import contextmanager

import torch

from verl_mega.parallel.process_exit import exit_process
from verl_mega.parallel.safe_path import without_working_folder
from verl_mega.parallel.spawn import LAUNCH_COMMAND_ENV, RANK_THREADS, StoppedBySignal, run_torchrun
from verl_mega.parallel.world import single_process_world
from verl_mega.trainer.main import main as trainer_main

from .payload import (
    TRAINER_MODULE, add_payload_arguments, add_rollout_ranks, check_trainer_config, parse_env, payload_from_args,
    split_passthrough,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-mega launch local",
        description="Run the payload under torchrun on this machine. Arguments after -- go to --module verbatim.",
    )
    parser.add_argument("--nproc", type=int, required=True,
                        help="number of ranks (the training ranks, with --rollout-nproc)")
    parser.add_argument("--rollout-nproc", type=int, default=0,
                        help="rollout-only ranks started after the --nproc training ones (parallel.rollout_ranks)")
    add_payload_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, passthrough = split_passthrough(argv)
    parser = build_parser()
    args = parser.parse_args(own)
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.rollout_nproc < 0:
        parser.error(f"--rollout-nproc must be >= 0, got {args.rollout_nproc}")
    world = args.nproc + args.rollout_nproc
    try:
        add_rollout_ranks(args, args.rollout_nproc, "--rollout-nproc")
        payload = payload_from_args(args, passthrough)
        env = parse_env(args.env)
        # What a rank of a stopped run tells the user to run again to resume.
        env.setdefault(LAUNCH_COMMAND_ENV, shlex.join(["verl-mega", "launch", "local", *argv]))
        check_trainer_config(args, passthrough, world)
    except ValueError as error:
        parser.error(str(error))
    if world == 1 and payload.module == TRAINER_MODULE and not args.env:
        return train_in_this_process(list(payload.args), env)
    try:
        run_torchrun(world, payload.module, list(payload.args), env=env)
    except subprocess.CalledProcessError as error:  # the failed rank's message is already the last line
        return error.returncode
    except StoppedBySignal:  # saved: the trainer's last line says where, and how to resume
        return 0
    return 0


def train_in_this_process(trainer_args: list[str], env: dict[str, str]) -> int:
    """`verl-mega train TRAINER_ARGS` as torchrun's only rank would run it, here, with the launcher's variables
    for its rank `env` (none of them given by --env); its exit code."""
    threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": RANK_THREADS}
    pool = torch.get_num_threads()
    with rank_environment({**threads, **env}), without_working_folder():
        if threads:  # torch read the variable at import: set its pool as well
            torch.set_num_threads(int(RANK_THREADS))
        try:
            return trainer_main(trainer_args)
        finally:  # the launcher's pool again, like its environment (a script may go on computing)
            torch.set_num_threads(pool)


@contextmanager
def rank_environment(env: dict[str, str]):
    """torchrun's variables for a world of one on a free local port, and `env`; the earlier values put back after
    (a test or a script that launches again reads its own environment)."""
    variables = {**single_process_world().torchrun_environment(), **env}
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


if __name__ == "__main__":
    exit_process(main())
