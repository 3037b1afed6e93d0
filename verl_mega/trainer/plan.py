"""`verl-mega plan`: the HybridEngine transition's bytes (`rollout.planner`), or with `--memory CONFIG` the run's
predicted memory per rank, FLOPs and bytes moved (`planning.memory`), and the layouts that fit a GPU.

    verl-mega plan --memory CONFIG [key=value ...] [--json] [--gpus N --gpu-memory GIB] [--suggest]

It sits with the trainer because which roles a step runs (critic, reference) is the RL job's decision
(`trainer.rl.needs`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from verl_mega.checkpoint.manifest import HF_ASSETS_DIR
from verl_mega.config import TrainConfig, load_config
from verl_mega.config.errors import UserError
from verl_mega.hub import resolve_inputs
from verl_mega.planning.memory import ATTENTION_KERNELS, FLASH, Model, Roles, layout_of, plan_memory, suggest_layouts
from verl_mega.rollout import planner

from .rl.needs import model_keys, teacher_folders, uses_critic, uses_reference, uses_teacher

MEMORY_FLAG = "--memory"


def roles_of(config: TrainConfig) -> Roles:
    return Roles(critic=uses_critic(config), reference=uses_reference(config), teachers=teacher_config_folders(config))


def teacher_config_folders(config: TrainConfig) -> tuple[str, ...]:
    """Where each distillation teacher's config.json is: its HF folder, or a teacher.ckpt's copied HF assets."""
    folders = list(teacher_folders(config).values())
    if uses_teacher(config) and config.teacher.ckpt:
        folders.append(str(Path(config.teacher.ckpt) / HF_ASSETS_DIR))
    return tuple(folders)


def memory_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"verl-mega plan {MEMORY_FLAG}", description=__doc__.split("\n\n")[0])
    parser.add_argument(MEMORY_FLAG, required=True, metavar="CONFIG", help="the run's YAML config")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, as `verl-mega train` takes them")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--gpus", type=int, help="ranks of the run (default: parallel.tp x parallel.pp)")
    parser.add_argument("--gpu-memory", type=float, metavar="GIB", help="memory of one GPU, GiB: say whether it fits")
    parser.add_argument("--suggest", action="store_true",
                        help="with --gpus and --gpu-memory: the layouts that fit, cheapest first (least recompute, "
                             "fewest model-parallel ranks, no distributed optimizer, largest micro-batch)")
    parser.add_argument("--attention", choices=ATTENTION_KERNELS, default=FLASH,
                        help="flash: a fused kernel (transformer-engine on a GPU) keeps no s^2 matrix; unfused: "
                             "megatron's local attention")
    return parser


def memory_main(argv: list[str]) -> int:
    parser = memory_parser()
    args = parser.parse_args(argv)
    if args.suggest and (args.gpus is None or args.gpu_memory is None):
        parser.error("--suggest needs --gpus and --gpu-memory")
    for flag, value in (("--gpus", args.gpus), ("--gpu-memory", args.gpu_memory)):
        if value is not None and not value > 0:
            parser.error(f"{flag} must be > 0, got {value}")
    try:
        config = load_config(args.memory, args.overrides)
        config = resolve_inputs(config, model_keys(config), model_configs_only=True)
        model = Model(config)
        roles = roles_of(config)
        if args.suggest:
            plans = suggest_layouts(model, roles, args.gpus, args.gpu_memory, attention=args.attention)
        else:
            plans = [plan_memory(model, layout_of(config, args.gpus), roles, args.gpu_memory, args.attention)]
    except (UserError, ValueError, OSError) as err:
        parser.exit(2, f"verl-mega plan: error: {err}\n")
    if args.json:
        print(json.dumps([found.to_json() for found in plans] if args.suggest else plans[0].to_json(), indent=1))
    elif args.suggest and not plans:
        print(f"no layout of {args.gpus} GPUs fits {args.gpu_memory:g} GiB")
    else:
        print("\n\n".join(found.format() for found in plans))
    return 0 if args.suggest or plans[0].fits is not False else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if MEMORY_FLAG in argv:
        return memory_main(argv)
    planner.main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
