"""One PPO iteration of the demo model at layouts (1,1,1) and (2,2,2), in fp32 and bf16: tokens/s and time per
stage.

Runs the real trainer (`examples/ppo_gae_demo.yaml`) for a few steps per layout and dtype on the same model and
reports the last step's breakdown, so the slowest stage is visible, and bf16's speed-up over fp32 at each
layout.  Usage: python -m bench.ppo_step [--steps 3] [--dtypes fp32 bf16]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

LAYOUTS = {(1, 1, 1): ["parallel.tp=1", "parallel.pp=1", "actor.micro_batch_size=16", "critic.micro_batch_size=16"],
           (2, 2, 2): ["parallel.tp=2", "parallel.pp=2"]}


def main() -> None:
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES, train
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.run.folder import RunFolder
    from verl_mega.trainer.plot import read_metrics

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="the first steps include warm-up; the last is reported")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = make_tiny_hf_model(tmp / "hf", "qwen2", vocab_size=64)
        data = write_rows(make_task_rows("copy", 256, seed=0, max_digits=2), tmp / "copy.jsonl")
        results = {}
        for (tp, pp, dp), overrides in LAYOUTS.items():
            for dtype in args.dtypes:
                run_dir = tmp / f"run_{tp}{pp}{dp}_{dtype}"
                train(EXAMPLES / "ppo_gae_demo.yaml", tp * pp * dp, [
                    f"model.hf_path={hf}", f"data.train_files=[{data}]", f"trainer.run_dir={run_dir}",
                    f"trainer.total_steps={args.steps}", f"model.dtype={dtype}", *overrides,
                ])
                results[((tp, pp, dp), dtype)] = read_metrics(RunFolder(run_dir).metrics)[-1]
    stages = sorted({key for record in results.values() for key in record if key.startswith("timing/")})
    print(f"{'stage (s)':<22}" + "".join(f"{f'{layout} {dtype}':>18}" for layout, dtype in results))
    for stage in stages:
        print(f"{stage[len('timing/'):]:<22}" + "".join(f"{r.get(stage, 0.0):>18.3f}" for r in results.values()))
    for key, label in (("perf/step_seconds", "step (s)"), ("perf/tokens_per_second", "tokens/s"),
                       ("perf/peak_rss_gib", "peak RSS (GiB)")):
        print(f"{label:<22}" + "".join(f"{r[key]:>18.3f}" for r in results.values()))
    for (layout, dtype), record in results.items():
        slowest = max(stages, key=lambda stage: record.get(stage, 0.0))
        print(f"{layout} {dtype}: slowest stage {slowest[len('timing/'):]} ({record[slowest]:.3f} s of "
              f"{record['perf/step_seconds']:.3f} s)")
    for layout in LAYOUTS:
        for dtype in args.dtypes[1:]:
            baseline, other = results[(layout, args.dtypes[0])], results[(layout, dtype)]
            print(f"{layout}: {dtype} step time {other['perf/step_seconds'] / baseline['perf/step_seconds']:.2f}x "
                  f"{args.dtypes[0]}'s, tokens/s {other['perf/tokens_per_second'] / baseline['perf/tokens_per_second']:.2f}x")

if __name__ == "__main__":
    main()
