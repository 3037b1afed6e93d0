"""The same GRPO work in the rollout modes and placements, one after the other in one run.

    python -m bench.async_step [--scale tiny|llama100m] [--steps 5] [--threads 1] [--modes NAME ...]

bench/vs_trl.py's GRPO step (8 prompts x 4 samples of the copy task, fp32, random weights that generate to the
length limit, so every mode decodes the same tokens) through the real trainer in:

    sync colocated        1 process that generates, then trains
    sync disaggregated    1 training + 1 rollout process (parallel.rollout_ranks=1), taking turns
    one_step_off          the same 2 processes, the rollout rank generating step k + 1's batch during step k
    async                 the same, max_staleness 2: up to 3 batches requested ahead
    async partial         the same with partial rollouts (finish) in chunks of 16 tokens: the rollout rank
                          generates the next step's groups during the update, taking each push between chunks

Printed per mode, medians over the steps after the first: step time, completion tokens/s, the idle share of
each side (training: waiting for responses, `timing/rollout_wait`, or colocated generating; rollout: the part
of the step it neither generated nor loaded weights, `timing/rollout_ranks_busy`), the staleness histogram
(`async/staleness_hist/<k>`, mean over the steps) and the reward per step; then one_step_off's step time over
disaggregated sync's (goal <= 0.65: the overlap's limit is max(generate, train) / (generate + train)).

A second table says where a step's time goes on each side, medians in seconds: the weight push
(`timing/transition`, both sides busy), the training rank's busy time (the step less its wait) and CPU time
(`perf/step_cpu_seconds`), the rollout rank's busy time and CPU time (`timing/rollout_ranks_busy`,
`timing/rollout_ranks_cpu`). Disaggregated sync runs each side alone (they take turns), one_step_off both
together, so the two rows compare each side alone with the same work beside the other: a side whose wall time
grows with its CPU time was slowed by memory (stalled cycles count as CPU time), one whose wall time grows alone
waited for a core. The one_step_off step the sides alone would allow, the push then the longer side's rest, with
disaggregated sync's figures, is printed over sync's step: the goal's limit on this machine.

Every process runs `--threads` threads, so the disaggregated placements use one more core than the colocated one.
The machine's load average is printed before and after: a shared machine slows every mode, not alike.
`--modes` runs some of the modes only (the table's names).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench.vs_trl import BUILDERS, SCALES, SEQUENCES_PER_STEP, copy_rows, grpo_config

DISAGGREGATED = ("parallel.rollout_ranks=1",)
PARTIAL_CHUNK = 16  # tokens: two chunks of the 32 new tokens (bench.partial_chunks: 0.49x one call's tokens/s)
MODES = {  # name -> (processes, overrides)
    "sync colocated": (1, ()),
    "sync disaggregated": (2, DISAGGREGATED),
    "one_step_off": (2, (*DISAGGREGATED, "rollout.mode=one_step_off")),
    "async (max_staleness 2)": (2, (*DISAGGREGATED, "rollout.mode=async", "rollout.max_staleness=2")),
    "async partial (finish)": (2, (*DISAGGREGATED, "rollout.mode=async", "rollout.max_staleness=2",
                                   "rollout.partial=finish", f"rollout.partial_chunk_tokens={PARTIAL_CHUNK}")),
}
GOAL = 0.65  # one_step_off's step time over disaggregated sync's


def run_mode(hf_dir: Path, data: Path, config: Path, nproc: int, overrides: tuple, threads: int, run_dir: Path
             ) -> list[dict]:
    from verl_mega.parallel.spawn import run_torchrun
    from verl_mega.run.folder import RunFolder
    from verl_mega.trainer.plot import read_metrics

    run_torchrun(nproc, "verl_mega.trainer.main", [
        "--config", str(config), f"model.hf_path={hf_dir}", f"data.train_files=[{data}]",
        f"trainer.run_dir={run_dir}", *overrides], env={"OMP_NUM_THREADS": str(threads)})
    return read_metrics(RunFolder(run_dir).metrics)


def summarise(records: list[dict], colocated: bool) -> dict:
    """Medians over the steps after the first (warm-up), the mean staleness histogram, the reward per step."""
    measured = records[1:] or records
    step = statistics.median(r["perf/step_seconds"] for r in measured)

    def share(record: dict, stages: tuple[str, ...]) -> float:
        return sum(record.get(f"timing/{stage}", 0.0) for stage in stages) / record["perf/step_seconds"]

    if colocated:  # one process: it trains or generates, never both
        train_idle = statistics.median(share(r, ("rollout", "transition")) for r in measured)
        rollout_idle = 1 - statistics.median(share(r, ("rollout", "transition")) for r in measured)
    else:
        train_idle = statistics.median(share(r, ("rollout_wait",)) for r in measured)
        rollout_idle = 1 - statistics.median(share(r, ("rollout_ranks_busy",)) for r in measured)
    sides = {"push": "timing/transition", "rollout_busy": "timing/rollout_ranks_busy",
             "rollout_cpu": "timing/rollout_ranks_cpu", "train_cpu": "perf/step_cpu_seconds"}
    seconds = {side: statistics.median(r.get(key, 0.0) for r in measured) for side, key in sides.items()}
    seconds["train_busy"] = statistics.median(r["perf/step_seconds"] - r.get("timing/rollout_wait", 0.0)
                                              for r in measured)
    lags = sorted({int(key.rsplit("/", 1)[1]) for r in records for key in r if key.startswith("async/staleness_hist/")})
    hist = {lag: statistics.mean(r.get(f"async/staleness_hist/{lag}", 0.0) for r in records) for lag in lags}
    tokens = statistics.median(r["response/length_mean"] for r in measured) * SEQUENCES_PER_STEP
    return {"step": step, "tokens_per_second": tokens / step, "train_idle": train_idle,
            "rollout_idle": rollout_idle, "staleness": hist or {0: 1.0}, "seconds": seconds,
            "reward": [round(r["reward/mean"], 4) for r in records]}


def report(results: dict[str, dict], load_before: tuple, load_after: tuple) -> None:
    print(f"load average before {load_before[0]:.1f} / {load_before[1]:.1f} / {load_before[2]:.1f}, after "
          f"{load_after[0]:.1f} / {load_after[1]:.1f} / {load_after[2]:.1f}")
    print(f"{'mode':26s} {'step s':>8s} {'tokens/s':>9s} {'train idle':>11s} {'rollout idle':>13s}  staleness  reward")
    for name, r in results.items():
        staleness = " ".join(f"{lag}:{share:.2f}" for lag, share in r["staleness"].items())
        print(f"{name:26s} {r['step']:8.2f} {r['tokens_per_second']:9.1f} {r['train_idle']:11.0%} "
              f"{r['rollout_idle']:13.0%}  {staleness:9s}  {r['reward']}")
    print(f"{'mode':26s} {'push s':>7s} {'train busy':>11s} {'train CPU':>10s} {'rollout busy':>13s} "
          f"{'rollout CPU':>12s}")
    for name, r in results.items():
        t = r["seconds"]
        print(f"{name:26s} {t['push']:7.2f} {t['train_busy']:11.2f} {t['train_cpu']:10.2f} {t['rollout_busy']:13.2f} "
              f"{t['rollout_cpu']:12.2f}")
    if {"one_step_off", "sync disaggregated"} <= results.keys():
        sync = results["sync disaggregated"]
        ratio = results["one_step_off"]["step"] / sync["step"]
        print(f"one_step_off / sync disaggregated step time: {ratio:.2f} (goal <= {GOAL}): "
              f"{'PASS' if ratio <= GOAL else 'FAIL'}; the sides alone would allow {overlap_limit(sync):.2f}")


def overlap_limit(sync: dict) -> float:
    """One_step_off's step over sync's if each side ran beside the other as fast as alone: the push, then the
    longer side (sync disaggregated's figures; both sides' busy times hold the push, the rollout rank's as the
    loading of what arrives)."""
    t = sync["seconds"]
    return (t["push"] + max(t["train_busy"], t["rollout_busy"]) - t["push"]) / sync["step"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.async_step")
    parser.add_argument("--scale", choices=sorted(SCALES), default="llama100m")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="threads of each process")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), metavar="NAME",
                        help="the modes to run, by the table's names (default: all)")
    args = parser.parse_args(argv)
    from verl_mega.data.tables import write_rows

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf_dir = BUILDERS[args.scale](root / "model")
        data = write_rows(copy_rows(256), root / "copy.jsonl")
        config = root / "grpo.yaml"
        config.write_text(grpo_config(SCALES[args.scale], args.steps))
        load_before = os.getloadavg()
        results = {name: summarise(run_mode(hf_dir, data, config, nproc, overrides, args.threads, root / f"run{i}"),
                                   colocated=nproc == 1)
                   for i, (name, (nproc, overrides)) in enumerate(MODES.items()) if name in args.modes}
        report(results, load_before, os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
