"""One PPO iteration of the demo model at layouts (1,1,1) and (2,2,2): tokens/s and time per stage.

Runs the real trainer (`examples/ppo_gae_demo.yaml`) for a few steps per layout and reports the last
step's breakdown, so the slowest stage is visible.  Usage: python -m bench.ppo_step [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

LAYOUTS = {(1, 1, 1): ["parallel.tp=1", "parallel.pp=1", "actor.micro_batch_size=16", "critic.micro_batch_size=16"],
           (2, 2, 2): ["parallel.tp=2", "parallel.pp=2"]}


def main() -> None:
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES, train
    from verl_mega.models.tiny import make_tiny_hf_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="the first steps include warm-up; the last is reported")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = make_tiny_hf_model(tmp / "hf", "qwen2", vocab_size=64)
        data = write_rows(make_task_rows("copy", 256, seed=0, max_digits=2), tmp / "copy.jsonl")
        results = {}
        for (tp, pp, dp), overrides in LAYOUTS.items():
            run_dir = tmp / f"run_{tp}{pp}{dp}"
            train(EXAMPLES / "ppo_gae_demo.yaml", tp * pp * dp, [
                f"model.hf_path={hf}", f"data.train_files=[{data}]", f"trainer.run_dir={run_dir}",
                f"trainer.total_steps={args.steps}", *overrides,
            ])
            results[(tp, pp, dp)] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    stages = sorted({key for record in results.values() for key in record if key.startswith("timing/")})
    print(f"{'stage (s)':<22}" + "".join(f"{str(layout):>14}" for layout in results))
    for stage in stages:
        print(f"{stage[len('timing/'):]:<22}" + "".join(f"{r.get(stage, 0.0):>14.3f}" for r in results.values()))
    for key, label in (("perf/step_seconds", "step (s)"), ("perf/tokens_per_second", "tokens/s"),
                       ("perf/peak_memory_gib", "peak RSS (GiB)")):
        print(f"{label:<22}" + "".join(f"{r[key]:>14.3f}" for r in results.values()))
    for layout, record in results.items():
        slowest = max(stages, key=lambda stage: record.get(stage, 0.0))
        print(f"{layout}: slowest stage {slowest[len('timing/'):]} ({record[slowest]:.3f} s of "
              f"{record['perf/step_seconds']:.3f} s)")


if __name__ == "__main__":
    main()
