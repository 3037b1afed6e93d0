"""A short RL job in this process (a world of one) whose generation and advantage stages record what they were
given and what they returned, each step's after a marker; written as JSON.

    python -m tests.advantages_worker OUT.json --config FILE.yaml [key=value ...]

The stages are the real ones: the wrappers only note each call, then make it.
"""
import json
import sys

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


if __name__ == "__main__":
    job = job_module.RLJob
    job.generate = recorded_generate(job.generate)
    job.compute_advantages = recorded_advantages(job.compute_advantages)
    code = main(sys.argv[2:])
    with open(sys.argv[1], "w") as out:
        json.dump(calls, out)
    sys.exit(code)
