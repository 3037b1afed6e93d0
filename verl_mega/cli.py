"""`verl-mega convert | plan | train | launch | export` — argument parsing only; the work is in the modules."""
from __future__ import annotations

import argparse
import sys


def _add_convert(subparsers) -> None:
    convert = subparsers.add_parser("convert", help="HF <-> Megatron checkpoints")
    kinds = convert.add_subparsers(dest="direction", required=True)

    to_mcore = kinds.add_parser("hf-to-mcore", help="HF folder -> Megatron TP/PP shards")
    to_mcore.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    to_mcore.add_argument("--out", required=True, help="output checkpoint folder (must not exist)")
    to_mcore.add_argument("--tp", type=int, default=1)
    to_mcore.add_argument("--pp", type=int, default=1)
    to_mcore.add_argument("--ep", type=int, default=1)
    to_mcore.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    to_mcore.add_argument("--format", default="megatron_legacy", choices=["megatron_legacy", "torch_dist"])
    to_mcore.add_argument("--overwrite", action="store_true")
    to_mcore.add_argument("--verify", action="store_true", help="check logit parity against transformers after")
    to_mcore.add_argument("--tolerance", type=float, default=1e-4, help="with --verify: fail above this max |Δ logit|")

    to_hf = kinds.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF folder")
    to_hf.add_argument("--ckpt", required=True)
    to_hf.add_argument("--out", required=True)
    to_hf.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="default: the checkpoint's")
    to_hf.add_argument("--overwrite", action="store_true")

    verify = kinds.add_parser("verify", help="logit parity: megatron-core from the shards vs transformers")
    verify.add_argument("--hf", required=True)
    verify.add_argument("--ckpt", required=True)
    verify.add_argument("--seq-len", type=int, default=16)
    verify.add_argument("--batch", type=int, default=2)
    verify.add_argument("--tolerance", type=float, default=1e-4, help="fail above this max |Δ logit|")


def _check_parity(hf_dir: str, ckpt_dir: str, tolerance: float, **kwargs) -> int:
    from verl_mega.converters.verify import verify_checkpoint

    diff = verify_checkpoint(hf_dir, ckpt_dir, **kwargs)
    print(f"max |Δ logit| = {diff:.3e} (tolerance {tolerance:g}): {'OK' if diff <= tolerance else 'FAILED'}")
    return 0 if diff <= tolerance else 1


def _run_convert(args) -> int:

    if args.direction == "hf-to-mcore":
        from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore

        manifest = convert_hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                                       fmt=args.format, overwrite=args.overwrite)
        print(f"wrote {manifest.family} {manifest.format} checkpoint tp={manifest.tp} pp={manifest.pp} "
              f"ep={manifest.ep} dtype={manifest.dtype} to {args.out}")
        if args.verify:
            return _check_parity(args.hf, args.out, args.tolerance)
    elif args.direction == "mcore-to-hf":
        from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf

        convert_mcore_to_hf(args.ckpt, args.out, dtype=args.dtype, overwrite=args.overwrite)
        print(f"wrote HF model to {args.out}")
    else:
        return _check_parity(args.hf, args.ckpt, args.tolerance, seq_len=args.seq_len, batch=args.batch)
    return 0


# Subcommands whose module parses its own arguments: "words" -> "module:function".
DELEGATED = {
    ("launch", "slurm"): "verl_mega.launch.slurm:main",
    ("launch", "local"): "verl_mega.launch.local:main",
    ("train",): "verl_mega.trainer.main:main",
    ("plan",): "verl_mega.rollout.planner:main",
}


def _add_export(subparsers) -> None:
    export = subparsers.add_parser("export", help="a trained run's actor or critic -> an HF folder")
    export.add_argument("--ckpt", required=True, help="a run folder (its final actor / critic) or a checkpoint folder")
    export.add_argument("--out", required=True)
    export.add_argument("--role", default="actor", choices=["actor", "critic"],
                        help="critic: a *ForTokenClassification model with one label (the value)")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="default: the checkpoint's")
    export.add_argument("--overwrite", action="store_true")


def _run_export(args) -> int:
    from pathlib import Path

    from verl_mega.checkpoint.manifest import MANIFEST_NAME, Manifest
    from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf
    from verl_mega.checkpoint.role_weights import FINAL_ROLE_DIRS

    ckpt = Path(args.ckpt)
    run_role_dir = ckpt / FINAL_ROLE_DIRS[args.role]
    if not (ckpt / MANIFEST_NAME).is_file() and (run_role_dir / MANIFEST_NAME).is_file():
        ckpt = run_role_dir
    role = Manifest.read(ckpt).role
    if role != args.role:
        raise ValueError(f"{ckpt} holds the {role}'s weights, not the {args.role}'s: pass --role {role}, or the "
                         f"{args.role}'s checkpoint (a run folder's {FINAL_ROLE_DIRS[args.role]})")
    convert_mcore_to_hf(ckpt, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"exported the {args.role} of {ckpt} to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-mega", description=__doc__, epilog="also: " + ", ".join(
        " ".join(words) for words in DELEGATED))
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_convert(subparsers)
    _add_export(subparsers)
    return parser


def _delegate(argv: list[str]):
    import importlib

    for words, target in DELEGATED.items():
        if tuple(argv[: len(words)]) == words:
            module, function = target.split(":")
            return lambda: getattr(importlib.import_module(module), function)(argv[len(words):])
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    delegated = _delegate(argv)
    if delegated is not None:
        return delegated() or 0
    args = build_parser().parse_args(argv)
    try:
        return {"convert": _run_convert, "export": _run_export}[args.command](args)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as err:
        print(f"verl-mega {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
