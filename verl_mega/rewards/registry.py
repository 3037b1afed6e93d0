"""The names `reward.function` accepts, how a run names and records its function, and which functions need
the scoring worker's time limit."""
from __future__ import annotations

import hashlib
import inspect
from typing import Any, Callable

from verl_mega.config.errors import UserError
from verl_mega.config.named_functions import import_function

from .code_tests import code_tests_score
from .final_number import number_score
from .math_answers import dapo_score, gsm8k_score, math_score
from .router import default_score
from .rules import add_score, copy_score, exact_match_score

RewardFn = Callable[[Any, str, Any, Any], Any]  # -> a number, or a dict with a numeric "score"

REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "exact_match": exact_match_score,
    "copy": copy_score,
    "add": add_score,
    "number": number_score,
    "math": math_score,
    "gsm8k": gsm8k_score,
    "dapo": dapo_score,
    "code_tests": code_tests_score,
    "default": default_score,
}
# String comparisons linear in the answer's length: they run in the trainer's process, with no worker.
LINEAR_TIME = frozenset({"exact_match", "copy", "add", "number"})


def get_reward_fn(spec: str | RewardFn) -> RewardFn:
    """A registered name, "package.module:function" for a function defined elsewhere, or the function itself."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise UserError(f"reward function {spec!r} is neither a callable nor a name / 'module:function'")
    name = spec
    if ":" in name:
        return import_function(name, "reward function")
    if name not in REWARD_FUNCTIONS:
        raise UserError(
            f"unknown reward function {name!r}; registered: {', '.join(sorted(REWARD_FUNCTIONS))} "
            "(or give 'module:function')"
        )
    return REWARD_FUNCTIONS[name]


def needs_time_limit(spec: str | RewardFn) -> bool:
    """Whether the function runs in the scoring worker (when reward.timeout_s > 0): every function given by
    name except the linear-time ones. A callable handed over by the Python API runs in the trainer's process:
    the worker imports its function by name and cannot receive an object."""
    return isinstance(spec, str) and spec not in LINEAR_TIME


def reward_fn_name(spec: str | RewardFn) -> str:
    """How a run names its reward function: the registered name or "module:function" as given, or a callable's
    "module:qualname" (importable back when the function is defined at a module's top level)."""
    if isinstance(spec, str):
        return spec
    module, qualname = getattr(spec, "__module__", None), getattr(spec, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(spec)


def reward_fn_provenance(spec: str | RewardFn) -> dict[str, str]:
    """What scored a run: a registered function by its name (the package version pins its code); any other by
    the sha256 of its source, so an edited reward file shows up as a different one."""
    record = {"name": reward_fn_name(spec)}
    if isinstance(spec, str) and spec in REWARD_FUNCTIONS:
        return record
    function = get_reward_fn(spec)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):  # a builtin, a functools.partial, a function typed into a REPL
        source = None
    record["source_sha256"] = hashlib.sha256(source.encode()).hexdigest() if source is not None else "unavailable"
    return record
