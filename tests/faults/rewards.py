"""Reward functions that misbehave, as `reward.function: tests.faults.rewards:NAME` for the fault tests."""
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
