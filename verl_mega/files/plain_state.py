"""The plain state (JSON types: dicts, lists, ints, floats, strings) that a checkpoint's trainer_state.json holds:
what may go in (`check_plain`), and reading it back, each value checked for its type and range.

A checkpoint file is hostile until checked: the sampler, the KL controller, the reward normaliser, the trajectory
buffer and the partial rollouts read their state with these, checking every value before anything is rebuilt
from it; a bad one is a ValueError naming where it sits (`what`, the dotted key), so a load changes nothing or
everything. A bool is no int here, and a float must be finite: NaN passes every comparison a later check would
make.
"""
from __future__ import annotations

import math
from typing import Any


def entry(state: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """`state[key]`, which must be of `kind` (a bool is no int here); `what` names `state` ("": the file's top)."""
    if not isinstance(state, dict) or key not in state:
        raise ValueError(f"{what or 'it'} has no '{key}'")
    value = state[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise ValueError(f"{_key(what, key)} is {type(value).__name__}, not {_names(kind)}")
    return value


def count(state: Any, key: str, what: str, low: int = 0, high: int | None = None, note: str = "") -> int:
    """`state[key]`, an int in [low, high] (no upper bound without `high`); `note` says what bounds it."""
    value = entry(state, key, int, what)
    if value < low or (high is not None and value > high):
        raise ValueError(f"{_key(what, key)}={value} must be {_interval(low, high)}{note}")
    return value


def number(state: Any, key: str, what: str, low: float | None = None) -> float:
    """`state[key]`, a finite number (int or float) >= `low` where given, as a float."""
    value = float(entry(state, key, (int, float), what))
    if not math.isfinite(value) or (low is not None and value < low):
        raise ValueError(f"{_key(what, key)}={value} must be a finite number" + ("" if low is None else f" >= {low}"))
    return value


def ints(value: Any, what: str, low: int | None = None, high: int | None = None) -> list[int]:
    """A list of ints, each in [low, high] where given."""
    if not isinstance(value, list) or any(type(item) is not int for item in value):
        raise ValueError(f"{what} must be a list of integers")
    if value and ((low is not None and min(value) < low) or (high is not None and max(value) > high)):
        raise ValueError(f"{what} holds values outside [{low}, {high}]: {min(value)}..{max(value)}")
    return value


def floats(value: Any, what: str) -> list[float]:
    """A list of finite numbers, as floats."""
    if not isinstance(value, list) or any(type(item) not in (int, float) for item in value):
        raise ValueError(f"{what} must be a list of numbers")
    if not all(map(math.isfinite, value)):
        raise ValueError(f"{what} holds NaN/inf")
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


def _key(what: str, key: str) -> str:
    return f"{what}.{key}" if what else key


def _interval(low: int, high: int | None) -> str:
    return f">= {low}" if high is None else f"in [{low}, {high}]"


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _kinds(kind))
