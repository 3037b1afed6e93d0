"""Short RL jobs run in turn in this process (each a world of one), as `verl-mega train` runs them; written as
JSON, NAME -> {"code", "error"}. Each case's run folder holds its metrics for its test to read.

    python -m tests.workers.rl_cases_worker OUT.json --case NAME --config FILE.yaml [key=value ...] [--case NAME ...]

One process for every case: each would otherwise pay megatron-core's start-up for a run of seconds. A case that
raises is recorded with its traceback's end and the next one runs.
"""
import json
import sys
import traceback

from verl_mega.parallel.process_exit import exit_process
from verl_mega.trainer.main import main


def length_reward(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """The response's length in characters: a reward that differs between samples from the first step on."""
    return float(len(solution_str))


def split_cases(argv: list[str]) -> dict[str, list[str]]:
    """`--case NAME ARGS... --case NAME ARGS...` -> NAME -> that case's trainer arguments."""
    cases, current = {}, None
    args = iter(argv)
    for arg in args:
        if arg == "--case":
            current = cases.setdefault(next(args), [])
        elif current is None:
            raise SystemExit("rl_cases_worker: the arguments after OUT.json start with --case NAME")
        else:
            current.append(arg)
    return cases


def run_case(argv: list[str]) -> dict:
    try:
        return {"code": main(argv), "error": None}
    except Exception:  # recorded for that case's test; the other cases still run
        return {"code": None, "error": traceback.format_exc()[-3000:]}


if __name__ == "__main__":
    results = {name: run_case(argv) for name, argv in split_cases(sys.argv[2:]).items()}
    with open(sys.argv[1], "w") as out:
        json.dump(results, out)
    exit_process(0)
