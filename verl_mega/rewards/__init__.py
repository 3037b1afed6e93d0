"""Reward functions for verifiable tasks and the worker process that runs them under a time limit.

Every function has verl's `compute_score` signature, `fn(data_source, solution_str, ground_truth, extra_info)`,
and returns a number or a dict with a numeric "score" and extra fields (`results`). `registry` names them for
`reward.function`; `router` picks one by the row's data_source, as verl's `default_compute_score` does;
`worker` runs a named function in a child process that is killed and replaced when an answer takes too long.
The reward role (roles.reward) turns their scores into the trainer's token-level rewards.
"""
