"""A plain function (sync or async) as a tool: called in its own thread under the wall-clock limit, its
return value checked to be a string and cut to the output limit, whatever it raises turned into the result.

A sync function cannot be stopped from outside: past the limit its thread is abandoned (a daemon thread,
it runs on until the function returns) and the call's result is the timeout. An async one is cancelled."""
from __future__ import annotations

import asyncio
import inspect
import threading
import time
from typing import Callable

from .registry import tool_schema
from .results import ToolResult, failure, success


class FunctionTool:
    """`function` under `name`, its schema from its signature and docstring."""

    def __init__(self, name: str, function: Callable, timeout_s: float, max_output_chars: int):
        self.name, self.function = name, function
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self.schema = tool_schema(name, function)

    def run(self, arguments: dict) -> ToolResult:
        start = time.monotonic()
        outcome = call_with_limit(self.function, arguments, self.timeout_s, self.name)
        seconds = time.monotonic() - start
        if isinstance(outcome, Timeout):
            return failure("timeout", f"error: the tool {self.name} took more than {self.timeout_s:g} s", seconds)
        if isinstance(outcome, Raised):
            return failure("raised", f"error: {describe(outcome.error)}"[: self.max_output_chars], seconds)
        if not isinstance(outcome, str):
            return failure("not_a_string", f"error: the tool {self.name} returned {type(outcome).__name__}, "
                                           "not a string", seconds)
        return success(outcome, self.max_output_chars, seconds)


class Timeout:
    """The call ran past its limit."""


class Raised:
    """The call raised `error`."""

    def __init__(self, error: BaseException):
        self.error = error


def call_with_limit(function: Callable, arguments: dict, timeout_s: float, name: str):
    """function(**arguments)'s value (awaited when it is a coroutine), a Raised or a Timeout."""
    box: list = []

    def target():
        try:
            value = function(**arguments)
            if inspect.isawaitable(value):
                value = asyncio.run(asyncio.wait_for(value, timeout_s))
            box.append(value)
        except TimeoutError:  # asyncio.wait_for's: the coroutine was cancelled at the limit
            box.append(Timeout())
        except BaseException as error:  # the tool's own code: SystemExit and KeyboardInterrupt included
            box.append(Raised(error))

    thread = threading.Thread(target=target, name=f"tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return box[0] if box else Timeout()


def describe(error: BaseException) -> str:
    """'Type: message', even for an exception whose str() raises or is huge."""
    try:
        message = str(error)[:500]
    except Exception:
        message = "(its message could not be read)"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
