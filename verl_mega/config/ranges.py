"""The range of every number in the config, declared with its field, and the one walk that checks them all.

Each schema dataclass with int or float fields declares `RANGES`, a class-level dict from each such field to a
`Range`, next to the fields it bounds. A float must also be finite unless its range admits infinity: a NaN
passes every comparison a later check would make and reaches the weights, and an infinite rate or temperature
turns a step into noise. `tests/test_config_ranges.py` fails when a number of the schema has no range, so a
field added later cannot skip it. The same walk refuses a string (or a list's string) made of blanks only.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """[low, high] (either end open, or absent), plus `off`: one value outside it that switches the knob off,
    and `infinite`: +inf admitted (no limit). `note` says what a special value means, in the message."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    off: float | None = None
    infinite: bool = False
    note: str = ""

    def admits(self, value: float) -> bool:
        if value == self.off:
            return True
        if math.isnan(value) or (math.isinf(value) and not (self.infinite and value > 0)):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            text = (f"in {'(' if self.low_open else '['}{_number(self.low)}, "
                    f"{_number(self.high)}{')' if self.high_open else ']'}")
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        else:
            text = "a number" if self.infinite else "a finite number"
        if self.off is not None:
            text = f"{_number(self.off)} (off) or {text}"
        notes = [note for note in ("inf: no limit" if self.infinite else "", self.note) if note]
        return f"{text} ({'; '.join(notes)})" if notes else text


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def at_least(low: float, **kwargs) -> Range:
    return Range(low=low, **kwargs)


def above(low: float, **kwargs) -> Range:
    return Range(low=low, low_open=True, **kwargs)


def within(low: float, high: float, **kwargs) -> Range:
    return Range(low=low, high=high, **kwargs)


ANY = Range()  # any finite number (a signed coefficient, a threshold that may be negative)


def out_of_range(section: Any, prefix: str = "") -> dict[str, str]:
    """{dotted key: message} for every number of the dataclass instance `section` (and the dataclasses it holds)
    outside the range its class declares, and every string made of blanks only (a path or name that reads as
    set and names nothing: `trainer.run_dir='  '` made a folder of spaces); None (an unset optional) passes."""
    problems: dict[str, str] = {}
    ranges = declared_ranges(type(section))
    for field in dataclasses.fields(section):
        value, key = getattr(section, field.name), f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            problems.update(out_of_range(value, f"{key}."))
        elif _blank(value) or isinstance(value, list) and any(map(_blank, value)):
            problems[key] = f"{key}={value!r} is blank: leave it empty or give a value"
        elif field.name in ranges and value is not None and not isinstance(value, bool):
            bound = ranges[field.name]
            if not isinstance(value, (int, float)):
                problems[key] = f"{key} must be a number, got {value!r}"
            elif not bound.admits(value):
                # "finite" goes without saying for an interval, and is the whole range of an unbounded one.
                half_open = bound.high is None and (bound.low is not None or bound.off is not None)
                finite = "finite and " if half_open and math.isinf(value) and not bound.admits(math.inf) else ""
                problems[key] = f"{key} must be {finite}{bound.describe()}, got {value!r}"
    return problems


def _blank(value) -> bool:
    return isinstance(value, str) and value != "" and not value.strip()


def declared_ranges(schema_class: type) -> dict[str, Range]:
    """The RANGES of `schema_class` and of the classes it derives from (a subclass adds to them)."""
    ranges: dict[str, Range] = {}
    for cls in reversed(schema_class.__mro__):
        ranges.update(vars(cls).get("RANGES", {}))
    return ranges


def numeric_fields(schema_class: type, prefix: str = "") -> list[tuple[str, type, str]]:
    """(dotted key, dataclass, field name) of every int or float field under `schema_class` (lists and dicts
    aside), for the check that each has a range."""
    found = []
    hints = typing.get_type_hints(schema_class)
    for field in dataclasses.fields(schema_class):
        annotation = hints[field.name]
        if dataclasses.is_dataclass(annotation):
            found += numeric_fields(annotation, f"{prefix}{field.name}.")
        elif typing.get_origin(annotation) not in (list, dict):
            options = typing.get_args(annotation) or (annotation,)
            if any(option in (int, float) for option in options):
                found.append((f"{prefix}{field.name}", schema_class, field.name))
    return found
