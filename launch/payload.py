"""What a launcher runs: a module and its arguments, shared by the local and the Slurm launchers.

By default the payload is the trainer, `--config CONFIG overrides...` (`--job sft|dpo|ppo` sets its job);
`--module` swaps in any other entry point (the converters, the exporter) and everything after `--` is passed to
it verbatim.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from verl_mega.config import JOB_ALIASES, JOBS, load_config
from verl_mega.hub import resolve_inputs
from verl_mega.trainer.preflight import preflight_check
from verl_mega.trainer.rl.needs import model_keys

TRAINER_MODULE = "verl_mega.trainer.main"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Payload:
    module: str
    args: tuple[str, ...] = ()


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher arguments, arguments after the first `--`) — the latter are never parsed by the launcher."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def add_payload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--module", default=TRAINER_MODULE,
                        help=f"python module to run on every rank (default {TRAINER_MODULE})")
    parser.add_argument("--job", choices=[*JOBS, *JOB_ALIASES], help="the trainer's job (sets job=JOB); default: the config's `job`")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment variable for every rank; repeatable")
    parser.add_argument("config", nargs="?", help="config file, passed to the module as --config CONFIG")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. trainer.total_steps=10")


ROLLOUT_RANKS_KEY = "parallel.rollout_ranks"


def add_rollout_ranks(args: argparse.Namespace, rollout_ranks: int, flag: str) -> None:
    """Hand the trainer `parallel.rollout_ranks=N` for a launcher flag that places N rollout-only ranks (the
    last global ranks); raises ValueError for another module or a second, explicit setting of the key."""
    if rollout_ranks == 0:
        return
    if args.module != TRAINER_MODULE:
        raise ValueError(f"{flag} places the trainer's rollout ranks; it does not apply to --module {args.module}")
    if any(override.startswith(f"{ROLLOUT_RANKS_KEY}=") for override in args.overrides):
        raise ValueError(f"{flag} sets {ROLLOUT_RANKS_KEY}; leave out the override {ROLLOUT_RANKS_KEY}=...")
    args.overrides = [*args.overrides, f"{ROLLOUT_RANKS_KEY}={rollout_ranks}"]


def payload_from_args(args: argparse.Namespace, passthrough: list[str]) -> Payload:
    """The module and its arguments; raises ValueError naming the missing or wrong argument."""
    module_args: list[str] = []
    if args.job is not None and args.module != TRAINER_MODULE:
        raise ValueError(f"--job {args.job} picks the trainer's job; it does not apply to --module {args.module}")
    if args.config is not None:
        config = Path(args.config)
        if not config.is_file():
            raise ValueError(f"config file {args.config} not found")
        # Absolute, because the job may start in another folder than the one it was submitted from.
        module_args += ["--config", str(config.resolve()), *args.overrides, *([f"job={args.job}"] if args.job else [])]
    elif args.module == TRAINER_MODULE:
        raise ValueError(f"CONFIG is required to launch the trainer ({TRAINER_MODULE}); "
                         "pass a config file, or --module M -- ARGS for another entry point")
    if not re.fullmatch(r"[A-Za-z_][\w.]*", args.module):
        raise ValueError(f"--module {args.module!r} is not a python module name (like verl_mega.converters.verify)")
    return Payload(args.module, tuple(module_args + passthrough))


def check_trainer_config(args: argparse.Namespace, passthrough: list[str], world_size: int) -> None:
    """For the trainer: the pre-flight check it runs itself at start-up, here and now with the job's world size, so a
    bad config is refused before anything is queued or started. Raises ConfigError (a ValueError)."""
    if args.module != TRAINER_MODULE or args.config is None:
        return
    # Hub ids are resolved here, once on this node before the ranks start (they find the cache warm).
    config = load_config(args.config, [*args.overrides, *passthrough])
    preflight_check(resolve_inputs(config, model_keys(config)), world_size)


def parse_env(pairs: list[str]) -> dict[str, str]:
    """NAME=VALUE strings from --env as a dict; raises ValueError naming a malformed one."""
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name):
            raise ValueError(f"--env {pair!r} must look like NAME=VALUE with NAME a shell variable name")
        env[name] = value
    return env
