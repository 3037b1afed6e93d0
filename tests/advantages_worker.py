"""Short RL jobs run in turn in this process (each a world of one) whose generation and advantage stages record
what they were given and what they returned; written as JSON, NAME -> {"code", "error", "calls"}.

    python -m tests.advantages_worker OUT.json --case NAME --config FILE.yaml [key=value ...] [--case NAME ...]

One process for every case: each would otherwise pay megatron-core's start-up for a run of seconds. A case that
raises is recorded with its traceback's end and the next one runs. The stages are the real ones: the wrappers
only note each call, then make it.
"""
import json
import sys
import traceback

from verl_mega.parallel.process_exit import exit_process
from verl_mega.trainer import rl as job_module
from verl_mega.trainer.main import main

calls: list[dict] = []
BATCH_KEYS = ("advantages", "response_mask", "old_log_probs", "sum_pi_squared")


def length_reward(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """The response's length in characters: a reward that differs between samples from the first step on."""
    return float(len(solution_str))


def recorded_generate(generate):
    def run(self, prompts, params=None, **kwargs):
        responses = generate(self, prompts, params, **kwargs)
        sampling = params or self.config.rollout
        calls.append({"stage": "generate", "prompts": len(prompts), "responses": len(responses),
                      "temperature": sampling.temperature})
        return responses

    return run


def recorded_advantages(compute_advantages):
    def run(self, batch, scores, token_scores, uids, reward_baselines=None):
        metrics = compute_advantages(self, batch, scores, token_scores, uids, reward_baselines)
        calls.append({"stage": "advantages", "scores": scores.tolist(), "token_scores": token_scores.tolist(),
                      "uids": list(uids),
                      "reward_baselines": None if reward_baselines is None else reward_baselines.tolist(),
                      **{key: batch[key].tolist() for key in BATCH_KEYS if key in batch}})
        return metrics

    return run


def split_cases(argv: list[str]) -> dict[str, list[str]]:
    """`--case NAME ARGS... --case NAME ARGS...` -> NAME -> that case's trainer arguments."""
    cases, current = {}, None
    args = iter(argv)
    for arg in args:
        if arg == "--case":
            current = cases.setdefault(next(args), [])
        elif current is None:
            raise SystemExit("advantages_worker: the arguments after OUT.json start with --case NAME")
        else:
            current.append(arg)
    return cases


def run_case(argv: list[str]) -> dict:
    calls.clear()
    try:
        code, error = main(argv), None
    except Exception:  # recorded for that case's test; the other cases still run
        code, error = None, traceback.format_exc()[-3000:]
    return {"code": code, "error": error, "calls": list(calls)}


if __name__ == "__main__":
    job = job_module.RLJob
    job.generate = recorded_generate(job.generate)
    job.compute_advantages = recorded_advantages(job.compute_advantages)
    results = {name: run_case(argv) for name, argv in split_cases(sys.argv[2:]).items()}
    with open(sys.argv[1], "w") as out:
        json.dump(results, out)
    exit_process(0)
