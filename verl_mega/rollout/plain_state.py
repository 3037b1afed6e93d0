"""The plain state (JSON types: dicts, lists, ints, floats, strings) that the partial rollout and the trajectory
buffer save into a checkpoint's job state: what may go in (`check_plain`), and reading it back.

A checkpoint file is hostile until checked: every value is checked for its type and range before anything is
rebuilt from it, and a bad one is a ValueError naming where it sits (`what`), so a load changes nothing or
everything.
"""
from __future__ import annotations

from typing import Any


def entry(state: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """`state[key]`, which must be of `kind` (a bool is no int here)."""
    if not isinstance(state, dict) or key not in state:
        raise ValueError(f"{what} has no '{key}'")
    value = state[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise ValueError(f"{what}.{key} is {type(value).__name__}, not {_names(kind)}")
    return value


def count(state: Any, key: str, what: str, low: int = 0) -> int:
    """`state[key]`, an int >= `low`."""
    value = entry(state, key, int, what)
    if value < low:
        raise ValueError(f"{what}.{key}={value} must be >= {low}")
    return value


def ints(value: Any, what: str, low: int | None = None, high: int | None = None) -> list[int]:
    """A list of ints, each in [low, high] where given."""
    if not isinstance(value, list) or any(type(item) is not int for item in value):
        raise ValueError(f"{what} must be a list of integers")
    if value and ((low is not None and min(value) < low) or (high is not None and max(value) > high)):
        raise ValueError(f"{what} holds values outside [{low}, {high}]: {min(value)}..{max(value)}")
    return value


def floats(value: Any, what: str) -> list[float]:
    """A list of numbers, as floats."""
    if not isinstance(value, list) or any(type(item) not in (int, float) for item in value):
        raise ValueError(f"{what} must be a list of numbers")
    return [float(item) for item in value]


_PLAIN_SCALARS = (str, int, float, bool, type(None))


def check_plain(value: Any, what: str, depth: int = 0) -> Any:
    """`value` if it is made of JSON types only (dicts with string keys, lists, tuples, scalars), else a
    ValueError naming `what`: a job state must survive json.dumps and hold nothing else."""
    if depth > 32:
        raise ValueError(f"{what} nests deeper than 32 levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{what} has a key {key!r} that is not a string")
            check_plain(item, f"{what}[{key!r}]", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{what}[{i}]", depth + 1)
    elif not isinstance(value, _PLAIN_SCALARS):
        raise ValueError(f"{what} holds a {type(value).__name__}; only JSON types can be saved with the run")
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _kinds(kind))
