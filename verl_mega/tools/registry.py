"""The tools a ToolSet can be built with: names registered by `register_tool`, or "module:function" for a
function defined elsewhere; and each tool's JSON schema, from its signature and docstring."""
from __future__ import annotations

import re
from typing import Callable

from transformers.utils import get_json_schema

from verl_mega.config.named_functions import import_function
from verl_mega.config.schema import ConfigError

# OpenAI's function names: what every chat template can render.
TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")

TOOLS: dict[str, Callable] = {}


def register_tool(name: str | None = None) -> Callable[[Callable], Callable]:
    """Decorator: make a plain function (sync or async) a tool under `name` (default: the function's name).
    Its type hints and its docstring (Google style, an `Args:` line per parameter) make its schema."""

    def register(function: Callable) -> Callable:
        tool_name = name or function.__name__
        if not TOOL_NAME.fullmatch(tool_name):
            raise ValueError(f"tool name {tool_name!r} must be letters, digits, _ or - (at most 64, not a digit first)")
        if TOOLS.get(tool_name, function) is not function:
            raise ValueError(f"a different tool is already registered as {tool_name!r}")
        tool_schema(tool_name, function)  # a function without a usable docstring fails here, not in a run
        TOOLS[tool_name] = function
        return function

    return register


def resolve_tool(spec: str, built_in: tuple[str, ...] = ()) -> tuple[str, Callable]:
    """(the tool's name, its function) for a registered name or "package.module:function"; `built_in`: the
    further names the caller knows, listed in the error for an unknown one."""
    if not isinstance(spec, str):
        raise ConfigError(f"tool {spec!r} must be a registered name or 'module:function'")
    if ":" not in spec:
        if spec not in TOOLS:
            raise ConfigError(f"unknown tool {spec[:80]!r}; registered: {', '.join(sorted([*TOOLS, *built_in]))} "
                              "(or give 'module:function')")
        return spec, TOOLS[spec]
    function = import_function(spec, "tool", ConfigError)
    function_name = spec.partition(":")[2]
    if not TOOL_NAME.fullmatch(function_name):
        raise ConfigError(f"tool {spec!r}: the name {function_name!r} is longer than 64 characters")
    return function_name, function


def tool_schema(name: str, function: Callable) -> dict:
    """The OpenAI function-format schema chat templates take as `tools=` (transformers' get_json_schema, the
    one apply_chat_template makes from a function), under `name`."""
    try:
        schema = get_json_schema(function)
    except Exception as error:  # DocstringParsingException, TypeHintParsingException, a signature it cannot read
        raise ConfigError(f"tool {name!r}: no JSON schema from its signature and docstring: {error}") from None
    schema["function"]["name"] = name
    return schema
