"""What a reward function's return value means: a score with extra fields (numeric ones become metrics, the
others go with the logged samples), or the problem that makes it unusable, for an error that names the function
and the row. The same reading applies in the trainer's process and in the scoring worker, whose verdicts cross
the pipe as JSON (`to_wire` / `from_wire`)."""
from __future__ import annotations

import json
import math
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


class Died(NamedTuple):
    """The scoring worker died on the answer (a crash in C code, os._exit, the kernel's OOM killer): it scores 0
    and is counted apart from the limits' stops."""
    reason: str


Verdict = Scored | Refused | Stopped | Died

# The largest finite float32: scores and metrics become float32 tensors, where a larger number turns into inf.
FLOAT32_MAX = 3.4028234663852886e38


class OutOfRange(ValueError):
    """A finite number no float32 score holds (a huge int, 1e300); its message describes the value."""


def as_number(value) -> float | None:
    """A real number as float (a one-element tensor or array through `.item()`), else None; OutOfRange for a
    finite one past FLOAT32_MAX (an int past float's range included). NaN and inf pass, for trainer.nonfinite."""
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int (or a Fraction) past float's range
        raise OutOfRange(_out_of_range(value)) from None
    if math.isfinite(number) and abs(number) > FLOAT32_MAX:
        raise OutOfRange(_out_of_range(value))
    return number


def as_json(value) -> Any:
    """`value` as plain JSON data, anything JSON has no type for as its str()."""
    return json.loads(json.dumps(value, default=str))


def _out_of_range(value) -> str:
    return f"{described(value)}, outside a float32 score's range (magnitude at most {FLOAT32_MAX:.3g})"


def described(value) -> str:
    """The value's type and its first 40 characters, for a message."""
    try:
        text = str(value)[:40]
    except ValueError:  # an int past Python's 4300 printable digits
        text = "(too many digits to print)"
    return f"{type(value).__name__} {text!r}"


def read_value(value) -> Scored | Refused:
    """A number is the score; a dict gives its "score" and extra fields (verl's dict rewards)."""
    if isinstance(value, dict):
        return _read_dict(value)
    try:
        number = as_number(value)
    except OutOfRange as err:
        return Refused(f"returned {err}")
    if number is None:
        return Refused(f"returned {described(value)}; it must return a number or a dict with a numeric 'score'")
    return Scored(number, {}, {})


def _read_dict(value: dict) -> Scored | Refused:
    if "score" not in value:
        return Refused(f"returned dict with fields {sorted(map(str, value))[:8]} but no 'score'")
    read: dict[str, tuple[Any, float | None]] = {}  # each field and its number (None: not a number)
    for key, field in value.items():
        try:
            read[str(key)] = field, as_number(field)
        except OutOfRange as err:
            return Refused(f"returned dict whose {str(key)!r} is {err}")
    score_field, score = read.pop("score")
    if score is None:
        return Refused(f"returned dict whose 'score' is {described(score_field)}; it must be a number")
    metrics = {key: number for key, (_, number) in read.items() if number is not None}
    fields = {key: as_json(field) for key, (field, number) in read.items() if number is None}
    return Scored(score, metrics, fields)


def call_reward(fn: Callable, row: tuple) -> Scored | Refused:
    """fn(data_source, solution_str, ground_truth, extra_info) read as a verdict. MemoryError is not the
    function's fault (an answer's blow-up under the worker's memory limit) and propagates."""
    try:
        value = fn(*row)
    except MemoryError:
        raise
    except SystemExit as exit_:  # it would end the trainer, or the worker with no word on why
        return Refused(f"called sys.exit({exit_.code!r})")
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
