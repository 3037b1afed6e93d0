"""PPO with GAE over NCCL at (1,1,1) against the same run on the CPU with gloo, for `bench/gpu_check.sh`.

    python -m bench.gpu_ppo_check WORK [--sides cuda cpu] [--dry-run]

Both runs train the same tiny Qwen2 (WORK/hf) on the copy task for 3 steps in fp32 with greedy rollouts
(temperature 0, so both sides roll out the same tokens) through `verl-mega launch local --nproc 1`; the CPU one
hides the GPU (CUDA_VISIBLE_DEVICES=""), so it runs on gloo. Checks:
  losses:  every step's actor and critic losses agree within LOSS_RTOL;
  weights: the exported final actors agree: |w_gpu - w_cpu| / |w_cpu - w_start| <= WEIGHT_RTOL (the difference
           relative to what training moved);
  greedy:  the embedded engine's greedy responses of step 3, rolled out with the weights of step 2, equal
           transformers' greedy generations on step 2's exported checkpoint, and differ from the start's (so
           an engine that kept stale weights fails).
The bounds are multiples of fp32's unit roundoff u = 2^-24: the two sides sum in different orders (cuBLAS and
NCCL vs the CPU's BLAS and gloo), a few roundings per operation, grown through the layers, the 2 PPO epochs x 2
mini-batches per step and 3 steps. --sides cpu cpu runs the same comparison with both runs on the CPU (a check
of the check, where no GPU is). Exit status 1 on any miss.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from verl_mega.api import load_policy
from verl_mega.data.synthetic import make_task_rows
from verl_mega.data.tables import write_rows
from verl_mega.models.tiny import make_tiny_hf_model

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "ppo_gae_demo.yaml"
STEPS = 3
UNIT_ROUNDOFF = 2.0**-24  # fp32: model.dtype below
LOSS_RTOL = 2**12 * UNIT_ROUNDOFF
WEIGHT_RTOL = 2**14 * UNIT_ROUNDOFF
LOSS_KEYS = ("actor/pg_loss", "critic/vf_loss")
MAX_RESPONSE_LENGTH = 4  # the config's data.max_response_length
OVERRIDES = ["parallel.tp=1", "parallel.pp=1", f"trainer.total_steps={STEPS}", "trainer.save_every=1",
             "model.dtype=fp32", "rollout.engine=embedded", "rollout.temperature=0", "actor.optim.lr=2e-3",
             "trainer.log_samples_every=1", "trainer.log_samples=16", "trainer.tensorboard=false",
             "reward.function=bench.gpu_reward:response_length"]
# CUDA_VISIBLE_DEVICES="" hides the GPU: the run takes the CPU and gloo (verl_mega.parallel picks by device).
SIDE_ENV = {"cuda": {}, "cpu": {"CUDA_VISIBLE_DEVICES": ""}}


def prepare(work: Path) -> tuple[Path, Path]:
    hf = make_tiny_hf_model(work / "hf", "qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    prompts = write_rows(make_task_rows("copy", 64, seed=0, max_digits=2), work / "prompts.jsonl")
    return hf, Path(prompts)


def cli(log: Path, *args: str, env: dict | None = None) -> None:
    """`verl-mega ARGS` in a child process (the public entry point), its output appended to `log` (so that this
    check's own output is its comparisons), the log's tail raised on failure."""
    with log.open("a") as out:
        done = subprocess.run([sys.executable, "-P", "-m", "verl_mega.cli", *args], stdout=out,
                              stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if done.returncode:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"verl-mega {' '.join(args[:2])} exited {done.returncode}; {log}:\n{tail}")


def train_command(hf: Path, prompts: Path, run_dir: Path) -> list[str]:
    return ["launch", "local", "--nproc", "1", str(CONFIG), f"model.hf_path={hf}", f"data.train_files=[{prompts}]",
            f"trainer.run_dir={run_dir}", *OVERRIDES]


def export(run_dir: Path, out: Path, step: int | None = None) -> Path:
    step_args = ["--step", str(step)] if step is not None else []
    cli(out.parent / "children.log", "export", "--ckpt", str(run_dir), "--out", str(out), "--dtype", "fp32",
        "--overwrite", *step_args)
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update({name: value.double() for name, value in load_file(file).items()})
    return tensors


def check_losses(run_a: Path, run_b: Path) -> list[str]:
    records_a, records_b = read_jsonl(run_a / "metrics.jsonl"), read_jsonl(run_b / "metrics.jsonl")
    if len(records_a) != STEPS or len(records_b) != STEPS:
        return [f"losses: {len(records_a)} and {len(records_b)} step records, want {STEPS} each"]
    misses = []
    for step, (a, b) in enumerate(zip(records_a, records_b), start=1):
        for key in LOSS_KEYS:
            gap, limit = abs(a[key] - b[key]), LOSS_RTOL * (1 + abs(b[key]))
            print(f"step {step} {key}: {a[key]:.8f} vs {b[key]:.8f}, |Δ| {gap:.2e} (bound {limit:.2e})")
            if not gap <= limit:
                misses.append(f"step {step} {key}: |Δ| {gap:.2e} > {limit:.2e}")
    return misses


def check_weights(final_a: Path, final_b: Path, start: Path) -> list[str]:
    a, b, w0 = weights(final_a), weights(final_b), weights(start)
    if a.keys() != b.keys():
        return [f"weights: the exports hold different tensors ({sorted(a.keys() ^ b.keys())[:4]})"]
    difference = sum(float((a[n] - b[n]).square().sum()) for n in a) ** 0.5
    moved = sum(float((b[n] - w0[n]).square().sum()) for n in b if n in w0) ** 0.5
    worst = max(a, key=lambda n: float((a[n] - b[n]).abs().max()))
    ratio = difference / max(moved, 1e-30)
    print(f"final actor weights: |w_a - w_b| {difference:.3e} over |w_b - w_start| {moved:.3e} = {ratio:.2e} "
          f"(bound {WEIGHT_RTOL:.2e}); largest elementwise gap in {worst}")
    misses = [] if ratio <= WEIGHT_RTOL else [f"weights: relative gap {ratio:.2e} > {WEIGHT_RTOL:.2e}"]
    return misses + ([] if moved > 0 else ["weights: training moved nothing"])


def messages(prompt_text: str) -> list[dict]:
    """A logged prompt ("role: content" per line, as generations.jsonl writes chat prompts) as chat messages."""
    rows = [line.split(": ", 1) for line in prompt_text.splitlines()]
    return [{"role": role, "content": content} for role, content in rows]


def greedy(folder: Path, prompts: list[str], device: str) -> list[str]:
    policy = load_policy(folder, device=device)
    return [policy.generate(messages(prompt), max_new_tokens=MAX_RESPONSE_LENGTH) for prompt in prompts]


def check_greedy(run_dir: Path, work: Path, start: Path, device: str) -> list[str]:
    samples = [row for row in read_jsonl(run_dir / "generations.jsonl") if row["step"] == STEPS]
    if not samples:
        return [f"greedy: no samples of step {STEPS} in generations.jsonl"]
    prompts = [row["prompt"] for row in samples]
    engine = [row["response"] for row in samples]
    trained = greedy(export(run_dir, work / f"export_step{STEPS - 1}", step=STEPS - 1), prompts, device)
    initial = greedy(start, prompts, device)
    same = sum(e == t for e, t in zip(engine, trained))
    changed = sum(t != i for t, i in zip(trained, initial))
    print(f"step {STEPS} greedy rollouts: {same} of {len(engine)} equal transformers' on step {STEPS - 1}'s export; "
          f"{changed} differ from the start's weights; first: {engine[0]!r} vs {trained[0]!r}")
    misses = [] if same == len(engine) else [f"greedy: {len(engine) - same} of {len(engine)} responses differ: "
                                             f"{[(e, t) for e, t in zip(engine, trained) if e != t][:3]}"]
    return misses + ([] if changed else ["greedy: no response moved since the start, the comparison shows nothing"])


def run(work: Path, sides: list[str]) -> list[str]:
    hf, prompts = prepare(work)
    runs = []
    for index, side in enumerate(sides):
        run_dir = work / f"run_{index}_{side}"
        cli(work / "children.log", *train_command(hf, prompts, run_dir), env=SIDE_ENV[side])
        runs.append(run_dir)
    finals = [export(run_dir, work / f"export_{run_dir.name}") for run_dir in runs]
    misses = check_losses(*runs) + check_weights(*finals, start=hf)
    return misses + check_greedy(runs[0], work, hf, "cuda" if sides[0] == "cuda" else "cpu")


def dry_run(work: Path, sides: list[str]) -> None:
    for index, side in enumerate(sides):
        env = " ".join(f"{key}={value!r}" for key, value in SIDE_ENV[side].items())
        command = train_command(work / "hf", work / "prompts.jsonl", work / f"run_{index}_{side}")
        print(f"would run ({side}) {env + ' ' if env else ''}verl-mega {' '.join(command)}")
    print(f"would compare {', '.join(LOSS_KEYS)} per step within {LOSS_RTOL:.1e} x (1 + |loss|), the exported "
          f"actors within {WEIGHT_RTOL:.1e} of the update, and step {STEPS}'s greedy rollouts with transformers' "
          f"on step {STEPS - 1}'s export")
    assert CONFIG.is_file(), CONFIG


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path, help="an empty folder for the model, data and runs")
    parser.add_argument("--sides", nargs=2, default=["cuda", "cpu"], choices=list(SIDE_ENV))
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run:
        dry_run(args.work, args.sides)
        return 0
    if "cuda" in args.sides and not torch.cuda.is_available():
        print("no CUDA device visible")
        return 1
    misses = run(args.work, args.sides)
    for miss in misses:
        print(f"MISS {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
