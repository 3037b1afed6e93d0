"""What a reward function's return value means: a score with extra fields (numeric ones become metrics, the
others go with the logged samples), or the problem that makes it unusable, for an error that names the function
and the row. The same reading applies in the trainer's process and in the scoring worker, whose verdicts cross
the pipe as JSON (`to_wire` / `from_wire`)."""
from __future__ import annotations

import json
import numbers
from typing import Any, Callable, NamedTuple

from verl_mega.config.errors import UserError


class Scored(NamedTuple):
    score: float  # NaN/inf pass through: the trainer stops or skips the batch (trainer.nonfinite)
    metrics: dict[str, float]  # the dict's numeric fields (bools count: an "acc" field is the accuracy)
    fields: dict[str, Any]  # its other fields, as JSON values


class Refused(NamedTuple):
    """The function's fault (it raised, or returned something that is not a score): the run stops naming it."""
    problem: str


class Stopped(NamedTuple):
    """The scoring worker's limits stopped the answer (time, memory): it scores 0 and is counted."""
    reason: str


Verdict = Scored | Refused | Stopped


def as_number(value) -> float | None:
    """A real number as float (a one-element tensor or array through `.item()`), else None."""
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1:
        value = value.item()
    return float(value) if isinstance(value, numbers.Real) else None


def as_json(value) -> Any:
    """`value` as plain JSON data, anything JSON has no type for as its str()."""
    return json.loads(json.dumps(value, default=str))


def _described(value) -> str:
    return f"{type(value).__name__} {str(value)[:40]!r}"


def read_value(value) -> Scored | Refused:
    """A number is the score; a dict gives its "score" and extra fields (verl's dict rewards)."""
    if isinstance(value, dict):
        return _read_dict(value)
    number = as_number(value)
    if number is None:
        return Refused(f"returned {_described(value)}; it must return a number or a dict with a numeric 'score'")
    return Scored(number, {}, {})


def _read_dict(value: dict) -> Scored | Refused:
    if "score" not in value:
        return Refused(f"returned dict with fields {sorted(map(str, value))[:8]} but no 'score'")
    score = as_number(value["score"])
    if score is None:
        return Refused(f"returned dict whose 'score' is {_described(value['score'])}; it must be a number")
    metrics, fields = {}, {}
    for key, field in value.items():
        if key == "score":
            continue
        number = as_number(field)
        if number is None:
            fields[str(key)] = as_json(field)
        else:
            metrics[str(key)] = number
    return Scored(score, metrics, fields)


def call_reward(fn: Callable, row: tuple) -> Scored | Refused:
    """fn(data_source, solution_str, ground_truth, extra_info) read as a verdict. MemoryError is not the
    function's fault (an answer's blow-up under the worker's memory limit) and propagates."""
    try:
        value = fn(*row)
    except MemoryError:
        raise
    except UserError as err:  # already a sentence for the user (e.g. the router's unknown data_source)
        return Refused(str(err))
    except Exception as err:
        return Refused(f"raised {type(err).__name__}: {err}")
    return read_value(value)


def to_wire(verdict: Verdict) -> bytes:
    return json.dumps({"kind": type(verdict).__name__, "value": list(verdict)}).encode()


def from_wire(data: bytes) -> Verdict:
    message = json.loads(data)
    kind = {"Scored": Scored, "Refused": Refused, "Stopped": Stopped}[message["kind"]]
    return kind(*message["value"])
