"""Learning curves of one_step_off against sync on a task the model learns, over the same samples.

    python -m bench.async_curves [--warm-seed 3] [--warm-target 0.6] [--steps 80] [--seeds 1 2 3]
                                 [--modes sync one_step_off ...] [--lr 1e-3] [--workdir DIR]

bench/async_step.py times the modes on a random model whose rewards do not move; this asks whether the
off-policy data learns as sync's does. From one warm model of `make demo`'s copy task (`verl_mega.demo`'s
warm-up at `--warm-seed`, stopped at `--warm-target`), `examples/grpo_demo.yaml` runs `--steps` steps per mode
and per seed S (`data.seed` and `rollout.seed` = S, so a pair of modes at one S starts from the same batches and
the same draws):

    sync                1 process that generates, then trains
    one_step_off        1 training + 1 rollout process (parallel.rollout_ranks=1), one version stale
    one_step_off_tis    the same with the token-level mismatch correction (rollout_correction.weights=token)

Printed per run: the reward mean over 20-step windows and the held-out greedy score every 10 steps; then per
mode the mean of the last window over the seeds, and each off-policy mode's difference from sync per seed (the
run-to-run noise is the seeds' spread of sync's last window). docs/async-rollout.md has the measured tables.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.demo import EXAMPLES, WARMUP_TARGET, train, warm_start
from verl_mega.run.folder import RunFolder
from verl_mega.trainer.plot import read_metrics

OFF_POLICY = ["parallel.rollout_ranks=1", "rollout.mode=one_step_off"]
MODES = {"sync": (1, []), "one_step_off": (2, OFF_POLICY),
         "one_step_off_tis": (2, [*OFF_POLICY, "algorithm.rollout_correction.weights=token"])}
WINDOW = 20


def run_mode(work: Path, warm: Path, files: tuple[Path, Path], mode: str, seed: int, steps: int, lr: float) -> dict:
    procs, extra = MODES[mode]
    run_dir = work / f"{mode}_s{seed}"
    train(EXAMPLES / "grpo_demo.yaml", procs, [
        f"model.hf_path={warm}", f"model.actor_ckpt={work / 'mcore_tp1_pp1'}", f"data.train_files=[{files[0]}]",
        f"data.val_files=[{files[1]}]", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
        "trainer.val_every=10", f"data.seed={seed}", f"rollout.seed={seed}", f"actor.optim.lr={lr}",
        f"actor.optim.min_lr={lr / 10}", *extra])
    records = read_metrics(RunFolder(run_dir).metrics)
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    return {"windows": [statistics.mean(rewards[i:i + WINDOW]) for i in range(0, len(rewards), WINDOW)],
            "heldout": [r["val/reward_mean"] for r in records if "val/reward_mean" in r]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bench.async_curves")
    parser.add_argument("--warm-seed", type=int, default=3, help="the demo's warm-up seed")
    parser.add_argument("--warm-target", type=float, default=WARMUP_TARGET,
                        help="the probe score the warm-up stops at (the demo's by default)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="data and sampling seeds")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument("--lr", type=float, default=1e-3, help="the actor's lr (min_lr a tenth of it)")
    parser.add_argument("--workdir", help="keep the runs here (default: a temp folder)")
    args = parser.parse_args(argv)
    for flag, value, ok, wanted in (("--steps", args.steps, args.steps >= 1, ">= 1"),
                                    ("--lr", args.lr, args.lr > 0, "> 0"),
                                    ("--warm-target", args.warm_target, 0 < args.warm_target <= 1, "in (0, 1]")):
        if not ok:
            parser.error(f"{flag} must be {wanted}, got {value}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        train_file, heldout_file, _, warm, _ = warm_start(work, args.warm_seed, args.warm_target)
        convert_hf_to_mcore(warm, work / "mcore_tp1_pp1", tp=1, pp=1, overwrite=True)
        results = {}
        for seed in args.seeds:
            for mode in args.modes:
                result = results[mode, seed] = run_mode(work, warm, (train_file, heldout_file), mode, seed,
                                                        args.steps, args.lr)
                print(f"{mode:18s} seed {seed}: reward per {WINDOW} steps "
                      f"{' '.join(f'{w:.3f}' for w in result['windows'])}; held-out every 10 steps "
                      f"{' '.join(f'{h:.3f}' for h in result['heldout'])}", flush=True)
    last = {key: result["windows"][-1] for key, result in results.items()}
    for mode in args.modes:
        print(f"{mode:18s} last window, mean over seeds {statistics.mean(last[mode, s] for s in args.seeds):.3f}"
              + ("" if mode == "sync" or "sync" not in args.modes else
                 "; minus sync per seed " + " ".join(f"{last[mode, s] - last['sync', s]:+.3f}" for s in args.seeds)))


if __name__ == "__main__":
    main()
