"""`verl-mega convert | export | plot | train | sft | preference | plan | generate | launch` — argument parsing only;
the work is in the modules. `dpo` is `preference` under its old name.

`convert`, `export` and `plot` are parsed here. `train`, `sft`, `preference`, `plan`, `generate` and `launch
slurm|local` parse their own arguments (they also run as `python -m` modules under torchrun and Slurm), so here
they only appear in the help and hand the rest of the command line to their module.
"""
from __future__ import annotations

import argparse
import importlib
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

from verl_mega.checkpoint.manifest import FORMATS
from verl_mega.checkpoint.roles import ROLES
from verl_mega.config.ranges import at_least
from verl_mega.converters.export import export_role
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf
from verl_mega.converters.verify import verify_checkpoint
from verl_mega.hub import is_repo_id, model_ref, resolve_model
from verl_mega.hub.push import push_folder
from verl_mega.models.builder import DTYPES
from verl_mega.parallel.process_exit import exit_process
from verl_mega.run.folder import RunFolder
from verl_mega.trainer.model_card import model_card
from verl_mega.trainer.plot import plot_run

DTYPE_NAMES = list(DTYPES)

# Subcommands whose module parses its own arguments: words -> ("module:function", help).
DELEGATED = {
    ("train",): ("verl_mega.trainer.main:main", "RL training (PPO, GRPO, ...) from a YAML config (run under torchrun "
                                                "or srun); the config's `job` may name sft or preference instead"),
    ("sft",): ("verl_mega.trainer.main:sft_main", "supervised fine-tuning on chat or prompt/response rows (torchrun)"),
    ("preference",): ("verl_mega.trainer.main:preference_main", "preference optimisation: algorithm.loss dpo | ipo | "
                                                                "kto | simpo | orpo (torchrun)"),
    ("dpo",): ("verl_mega.trainer.main:preference_main", "the `preference` command's old name"),
    ("plan",): ("verl_mega.trainer.plan:main", "HybridEngine dry run: per-rank bytes of a training -> rollout "
                                                "transition; with --memory CONFIG, the run's memory per rank, FLOPs "
                                                "and the layouts that fit a GPU"),
    ("generate",): ("verl_mega.trainer.generate:main", "sample responses from a checkpoint to a verl-format file "
                                                        "(a teacher's answers for the offline form of distillation)"),
    ("launch", "local"): ("verl_mega.launch.local:main", "torchrun on this machine"),
    ("launch", "slurm"): ("verl_mega.launch.slurm:main", "render and submit an sbatch script"),
}

FAMILY_SPEC_HELP = ("package.module:SPEC naming the FamilySpec of a family declared outside verl_mega "
                    "(recorded in the checkpoint's manifest)")
FAMILY_SPEC_OVERRIDE_HELP = "package.module:SPEC to use instead of the family spec the manifest records"
HF_HELP = "HF model folder (config.json + safetensors), or a Hub id org/name[@revision] (docs/hub.md)"


def _add_keep_remote_code(parser) -> None:
    parser.add_argument("--keep-remote-code", action="store_true",
                        help="keep the source's *.py files and auto_map (which make transformers run that code)")


def _add_convert(subparsers) -> None:
    convert = subparsers.add_parser("convert", help="HF <-> Megatron checkpoints")
    kinds = convert.add_subparsers(dest="direction", required=True)

    to_mcore = kinds.add_parser("hf-to-mcore", help="HF folder -> Megatron TP/PP shards")
    to_mcore.add_argument("--hf", required=True, help=HF_HELP)
    to_mcore.add_argument("--out", required=True, help="output checkpoint folder (must not exist)")
    to_mcore.add_argument("--tp", type=int, default=1)
    to_mcore.add_argument("--pp", type=int, default=1)
    to_mcore.add_argument("--ep", type=int, default=1)
    to_mcore.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES)
    to_mcore.add_argument("--format", default=FORMATS[0], choices=FORMATS)
    to_mcore.add_argument("--overwrite", action="store_true")
    _add_keep_remote_code(to_mcore)
    to_mcore.add_argument("--verify", action="store_true", help="check logit parity against transformers after")
    to_mcore.add_argument("--tolerance", type=tolerance,
                          help="with --verify: fail above this max |Δ logit| (default: the checkpoint dtype's rule)")
    to_mcore.add_argument("--family-spec", help=FAMILY_SPEC_HELP)

    to_hf = kinds.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF folder")
    to_hf.add_argument("--ckpt", required=True)
    to_hf.add_argument("--out", required=True)
    to_hf.add_argument("--dtype", choices=DTYPE_NAMES, help="default: the checkpoint's")
    to_hf.add_argument("--overwrite", action="store_true")
    _add_keep_remote_code(to_hf)
    to_hf.add_argument("--family-spec", help=FAMILY_SPEC_OVERRIDE_HELP)

    verify = kinds.add_parser("verify", help="logit parity: megatron-core from the shards vs transformers")
    verify.add_argument("--hf", required=True, help=HF_HELP)
    verify.add_argument("--ckpt", required=True)
    verify.add_argument("--seq-len", type=int, default=16)
    verify.add_argument("--batch", type=int, default=2)
    verify.add_argument("--tolerance", type=tolerance,
                        help="fail above this max |Δ logit| (default: the checkpoint dtype's rule)")
    verify.add_argument("--family-spec", help=FAMILY_SPEC_OVERRIDE_HELP)


def _add_export(subparsers) -> None:
    export = subparsers.add_parser("export", help="a trained run's actor or critic -> an HF folder")
    export.add_argument("--ckpt", required=True,
                        help="a run folder (its final actor / critic), a step checkpoint, or a checkpoint folder")
    export.add_argument("--step", type=int, help="with a run folder: export this step's checkpoint")
    export.add_argument("--out", required=True)
    export.add_argument("--role", default="actor", choices=ROLES,
                        help="critic: a *ForTokenClassification model with one label (the value)")
    export.add_argument("--dtype", choices=DTYPE_NAMES, help="default: the checkpoint's")
    export.add_argument("--merge", action="store_true",
                        help="a LoRA run's step: the adapters merged into the base, a plain HF folder (default: a "
                             "PEFT adapter folder)")
    export.add_argument("--overwrite", action="store_true")
    _add_keep_remote_code(export)
    export.add_argument("--family-spec", help=FAMILY_SPEC_OVERRIDE_HELP)
    export.add_argument("--push-to-hub", metavar="ORG/NAME",
                        help="upload the exported folder, with a generated model card (README.md), to this Hub repo")
    export.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    export.add_argument("--revision", default="main", help="with --push-to-hub: the branch to commit to")


def _add_plot(subparsers) -> None:
    plot = subparsers.add_parser("plot", help="a PNG of a run's reward, KL, response length and time per stage")
    plot.add_argument("run", help=f"the run folder (trainer.run_dir) holding {RunFolder('RUN').metrics.name}")
    plot.add_argument("--out", help=f"PNG to write (default: {RunFolder('RUN').plot})")


def _add_delegated(subparsers) -> None:
    groups = {}
    for words, (_, help_text) in DELEGATED.items():
        if len(words) == 1:
            subparsers.add_parser(words[0], help=help_text, add_help=False)
            continue
        if words[0] not in groups:
            group = subparsers.add_parser(words[0], help=f"{words[0]} a training job")
            groups[words[0]] = group.add_subparsers(dest="target", required=True)
        groups[words[0]].add_parser(words[1], help=help_text, add_help=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-mega", description="Megatron-backed RL post-training: convert HF "
                                     "checkpoints to Megatron shards, train, launch, export back to HF.")
    # The installed package's metadata (setup.py's version) is the one source of the version.
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('verl_mega')}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_convert(subparsers)
    _add_export(subparsers)
    _add_plot(subparsers)
    _add_delegated(subparsers)
    return parser


def tolerance(text: str) -> float:
    """--tolerance: a finite bound >= 0 on max |Δ logit| (NaN passed no comparison, so it failed every check;
    infinity passes every one)."""
    value = float(text)
    if not at_least(0).admits(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _check_parity(hf_dir: str, ckpt_dir: str, tolerance: float | None, **kwargs) -> int:
    parity = verify_checkpoint(hf_dir, ckpt_dir, **kwargs)
    passed = parity.passed if tolerance is None else parity.max_abs <= tolerance
    rule = "" if tolerance is None else f"; --tolerance {tolerance:g} on max |Δ logit|: {'OK' if passed else 'FAILED'}"
    print(parity.describe() + rule)
    return 0 if passed else 1


def _kept_only_if_verified(out: str, check) -> int:
    """Run the parity check of a conversion just written to `out`; a checkpoint that fails it (or whose check
    cannot run) is removed, so nothing that is not the model in the folder is left to train on."""
    try:
        code = check()
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    if code:
        shutil.rmtree(out, ignore_errors=True)
        print(f"removed {out}: a conversion that fails its parity check is not kept", file=sys.stderr)
    return code


def _run_convert(args) -> int:
    if getattr(args, "hf", None) and model_ref(args.hf):  # a Hub id: its snapshot in the HF cache
        args.hf = str(resolve_model(model_ref(args.hf)).path)
    if args.direction == "hf-to-mcore":
        manifest = convert_hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                                       fmt=args.format, overwrite=args.overwrite,
                                       keep_remote_code=args.keep_remote_code, family_spec=args.family_spec)
        print(f"wrote {manifest.family} {manifest.format} checkpoint tp={manifest.tp} pp={manifest.pp} "
              f"ep={manifest.ep} dtype={manifest.dtype} to {args.out}")
        if args.verify:
            return _kept_only_if_verified(args.out, lambda: _check_parity(args.hf, args.out, args.tolerance))
    elif args.direction == "mcore-to-hf":
        convert_mcore_to_hf(args.ckpt, args.out, dtype=args.dtype, overwrite=args.overwrite,
                            keep_remote_code=args.keep_remote_code, family_spec=args.family_spec)
        print(f"wrote HF model to {args.out}")
    else:
        return _check_parity(args.hf, args.ckpt, args.tolerance, seq_len=args.seq_len, batch=args.batch,
                             family_spec=args.family_spec)
    return 0


def _run_export(args) -> int:
    if not args.push_to_hub and (args.private or args.revision != "main"):
        raise ValueError("--private and --revision go with --push-to-hub ORG/NAME")
    if args.push_to_hub and not is_repo_id(args.push_to_hub):
        raise ValueError(f"--push-to-hub {args.push_to_hub}: give a repo id ORG/NAME (the branch goes in --revision)")
    source = export_role(args.ckpt, args.out, role=args.role, step=args.step, dtype=args.dtype,
                         overwrite=args.overwrite, keep_remote_code=args.keep_remote_code,
                         family_spec=args.family_spec, merge=args.merge)
    print(f"exported the {args.role} of {source} to {args.out}")
    if args.push_to_hub:
        (Path(args.out) / "README.md").write_text(model_card(args.push_to_hub, args.ckpt, args.role))
        commit = push_folder(args.out, args.push_to_hub, private=args.private, revision=args.revision)
        print(f"pushed {args.out} to {args.push_to_hub}@{args.revision} (commit {commit})")
    return 0


def _run_plot(args) -> int:
    print(f"wrote {plot_run(args.run, args.out)}")
    return 0


def _delegated(argv: list[str]):
    for words, (target, _) in DELEGATED.items():
        if tuple(argv[: len(words)]) == words:
            module, function = target.split(":")
            return lambda: getattr(importlib.import_module(module), function)(argv[len(words):])
    return None


def main(argv: list[str] | None = None) -> int:
    """The command `argv`'s exit code. Without `argv` it is the process's own command line (the `verl-mega` script):
    then the process ends here once the command is done, through `exit_process`, which skips CPython's freeing of
    the objects of torch, transformers and megatron-core that a training, a conversion or a launch imported
    (about 1 CPU-s)."""
    if argv is None:
        exit_process(run_command(sys.argv[1:]))
    return run_command(argv)


def run_command(argv: list[str]) -> int:
    delegated = _delegated(argv)
    if delegated is not None:
        return delegated() or 0
    args = build_parser().parse_args(argv)
    try:
        return {"convert": _run_convert, "export": _run_export, "plot": _run_plot}[args.command](args)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as err:
        print(f"verl-mega {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # disk full, quota, permissions: the environment, not a bug; name the path
        where = f"{err.filename}: " if err.filename else ""
        print(f"verl-mega {args.command}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    main()
