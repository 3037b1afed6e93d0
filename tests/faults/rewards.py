"""Reward functions that misbehave (and one that does not, for comparison), as
`reward.function: tests.faults.rewards:NAME` for the fault and reward tests."""
import math


def nan_reward(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan


def inf_reward(data_source, solution_str, ground_truth, extra_info=None):
    return math.inf


def none_reward(data_source, solution_str, ground_truth, extra_info=None):
    return None


def list_reward(data_source, solution_str, ground_truth, extra_info=None):
    return [1.0]


def str_reward(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"


def dict_reward(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}  # a dict reward without its "score"


def raising_reward(data_source, solution_str, ground_truth, extra_info=None):
    return {"a": 1}["answer"]


def graded_reward(data_source, solution_str, ground_truth, extra_info=None):
    """A well-behaved dict reward, as verl's math_dapo returns one: the score, a bool, a number and a string."""
    right = solution_str == ground_truth
    return {"score": 1.0 if right else -1.0, "acc": right, "length": len(solution_str), "pred": solution_str}


def hostile_on_nine(data_source, solution_str, ground_truth, extra_info=None):
    """math-verify's score, except that an answer "9" is replaced by a LaTeX power tower that makes sympy
    compute for far longer than any time limit (the tiny tokenizer cannot spell the tower itself)."""
    from verl_mega.rewards.math_answers import math_score

    answer = "\\boxed{9^{9^{9}}}" if solution_str.strip() == "9" else solution_str
    return math_score(data_source, answer, ground_truth)


def allocating_reward(data_source, solution_str, ground_truth, extra_info=None):
    """1 GiB at once: MemoryError under a smaller reward.memory_limit_mb, the blow-up a hostile answer causes."""
    return float(len(bytearray(2**30)) > 0)


def late_twice(data_source, solution_str, ground_truth, extra_info=None):
    """The run's first two answers take a minute, the others score 1 at once. Each call appends the pid of the
    process scoring it to $LATE_REWARD_LOG (one line per answer, "late" or "fast"), so a test can tell the
    workers apart and check none is left."""
    import os
    import time

    log = os.environ["LATE_REWARD_LOG"]
    late = not os.path.exists(log) or open(log).read().count("late") < 2
    with open(log, "a") as f:
        f.write(f"{os.getpid()} {'late' if late else 'fast'}\n")
    if late:
        time.sleep(60)
    return 1.0


def huge_int_reward(data_source, solution_str, ground_truth, extra_info=None):
    """An int no float holds: float() overflows on it."""
    return 10**400


def exiting_reward(data_source, solution_str, ground_truth, extra_info=None):
    import sys

    sys.exit(3)


def dies_on_nine(data_source, solution_str, ground_truth, extra_info=None):
    """1, except that an answer "9" ends the process scoring it at once (a crash in C code, the OOM killer)."""
    import os

    if solution_str.strip() == "9":
        os._exit(9)
    return 1.0


def dies_once(data_source, solution_str, ground_truth, extra_info=None):
    """The run's first answer ends the process scoring it at once; the others score 1. Each call appends the
    pid of the process scoring it to $DYING_REWARD_LOG (one line per answer)."""
    import os

    log = os.environ["DYING_REWARD_LOG"]
    first = not os.path.exists(log)
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    if first:
        os._exit(9)
    return 1.0
