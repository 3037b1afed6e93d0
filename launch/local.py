"""`verl-mega launch local`: run the payload under torchrun on this machine (no scheduler)."""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from verl_mega.parallel.spawn import LAUNCH_COMMAND_ENV, StoppedBySignal, run_torchrun

from .payload import (
    add_payload_arguments, add_rollout_ranks, check_trainer_config, parse_env, payload_from_args, split_passthrough,
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
    try:
        run_torchrun(world, payload.module, list(payload.args), env=env)
    except subprocess.CalledProcessError as error:  # the failed rank's message is already the last line
        return error.returncode
    except StoppedBySignal:  # saved: the trainer's last line says where, and how to resume
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
