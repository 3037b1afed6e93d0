"""The two values the agent loop and the tools exchange: the call the model asked for and what comes back.

A failed call is a result too (the model reads its text as the `tool` message); `error` names the failure's
category, the same short words the rollout counts in its metrics."""
from __future__ import annotations

from dataclasses import dataclass

# Every value ToolResult.error takes. output_truncated is the one that comes with ok=True.
ERROR_CATEGORIES = (
    "unknown_tool",        # a name the ToolSet was not built with
    "bad_json",            # the arguments are not JSON text
    "arguments_too_long",  # longer than tools.max_argument_chars (refused unparsed)
    "bad_arguments",       # not an object, a missing / unexpected parameter, a value of the wrong type
    "raised",              # the tool raised (python: the code exited with an error)
    "timeout",             # past tools.timeout_s
    "not_a_string",        # the tool returned something other than a str
    "output_truncated",    # cut to tools.max_output_chars (still ok)
    "cpu_limit",           # python: past tools.python.cpu_seconds
    "file_size_limit",     # python: wrote a file past tools.python.file_size_mb
    "killed",              # python: ended by another signal
    "sandbox",             # python: the sandbox could not be set up
)


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for, as the agent loop parsed it."""

    name: str
    arguments: str | dict  # the raw JSON text, or an already-parsed dict


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: `text` goes back to the model as the `tool` message (an error message on failure)."""

    text: str
    ok: bool
    error: str | None  # one of ERROR_CATEGORIES, None for a plain success
    seconds: float


def failure(error: str, text: str, seconds: float = 0.0) -> ToolResult:
    return ToolResult(text=text, ok=False, error=error, seconds=seconds)


def success(text: str, max_chars: int, seconds: float) -> ToolResult:
    """`text` cut to `max_chars` characters (counted as output_truncated, still a success)."""
    if len(text) <= max_chars:
        return ToolResult(text=text, ok=True, error=None, seconds=seconds)
    return ToolResult(text=text[:max_chars], ok=True, error="output_truncated", seconds=seconds)
