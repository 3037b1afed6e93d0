"""The reward of bench/gpu_ppo_check.py's runs: the response's length in characters, over 8.

A random tiny model never solves the copy task, so its own reward is 0 everywhere, the critic's returns and the
advantages are 0, and the losses and gradients the check compares would be 0 on both sides; the length varies
from row to row from the first step.
"""


def response_length(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    return len(solution_str) / 8
