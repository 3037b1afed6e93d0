"""A reward for runs of a random tiny model, as `reward.function: tests.sampling_rewards:NAME`: its responses are
random characters that the task rewards would all score 0, so no group would carry any signal."""


def odd_first_character(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the response's first character has an odd code point: about half the random responses."""
    return float(bool(solution_str) and ord(solution_str[0]) % 2 == 1)
