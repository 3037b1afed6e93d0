"""SFT and DPO steps of the tiny demo model at layouts (1,1,1) and (2,2,2): tokens/s and time per stage.

Runs the real jobs (`examples/sft_demo.yaml`, `examples/dpo_demo.yaml`) for a few steps per layout and reports
the last step (the first ones include warm-up). Usage: python -m bench.sft_dpo [--steps 4] [--layouts 1,1,1 ...]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

DEFAULT_LAYOUTS = ["1,1,1", "2,2,2"]


def main() -> None:
    from verl_mega.data.synthetic import make_task_rows, preference_pairs, sft_conversations
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES, train
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.run.folder import RunFolder
    from verl_mega.trainer.plot import read_metrics

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4, help="the first steps include warm-up; the last is reported")
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, help="TP,PP,DP of each run")
    args = parser.parse_args()
    layouts = [tuple(int(size) for size in layout.split(",")) for layout in args.layouts]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = make_tiny_hf_model(tmp / "hf", "qwen2", vocab_size=64)
        rows = make_task_rows("copy", 256, seed=0, max_digits=2)
        data = {"sft": write_rows(sft_conversations(rows), tmp / "sft.jsonl"),
                "dpo": write_rows(preference_pairs(rows), tmp / "pairs.jsonl")}
        results = {}
        for job, files in data.items():
            for tp, pp, dp in layouts:
                run_dir = tmp / f"{job}_{tp}{pp}{dp}"
                train(EXAMPLES / f"{job}_demo.yaml", tp * pp * dp, [
                    f"model.hf_path={hf}", f"data.train_files=[{files}]", f"trainer.run_dir={run_dir}",
                    f"trainer.total_steps={args.steps}", "trainer.tensorboard=false", f"parallel.tp={tp}",
                    f"parallel.pp={pp}",
                ])
                results[(job, tp, pp, dp)] = read_metrics(RunFolder(run_dir).metrics)[-1]
    print(f"{'job (tp,pp,dp)':<18}{'tokens/s':>12}{'step (s)':>12}  stages (s)")
    for (job, *layout), record in results.items():
        stages = " ".join(f"{key[len('timing/'):]}={value:.3f}" for key, value in sorted(record.items())
                          if key.startswith("timing/"))
        print(f"{job} {tuple(layout)!s:<14}{record['perf/tokens_per_second']:>12.0f}"
              f"{record['perf/step_seconds']:>12.3f}  {stages}")


if __name__ == "__main__":
    main()
