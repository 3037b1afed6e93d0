"""ToolSet: the tools one rollout may call, by name, with their schemas for the chat template; every call
checked and contained so that it never raises, and many calls run at once."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Sequence

from verl_mega.config.schema import ConfigError, ToolsConfig

from .arguments import ArgumentError, check_arguments, parse_arguments
from .functions import FunctionTool, describe
from .limits import limit_problems
from .registry import resolve_tool
from .results import ToolCall, ToolResult, failure
from .sandbox import PythonTool

# Built-in tools that need the config to exist (the sandbox's limits): built by name, not registered.
CONFIGURED_TOOLS = {"python": PythonTool}


class ToolSet:
    """The tools named in `names` (registered names, built-ins or "module:function"), limited by `config`.
    An unknown or unimportable name, one given twice or a limit out of its range is a ConfigError naming it."""

    def __init__(self, names: Sequence[str], config: ToolsConfig):
        if isinstance(names, str):  # one name where a list is due: iterating it would name each letter
            raise ConfigError(f"the tool names must be a list, got the string {names[:80]!r}")
        problems = limit_problems(config)
        if problems:
            raise ConfigError(problems[0])
        self.config = config
        self._tools: dict = {}
        for spec in names:
            tool = build_tool(spec, config)
            if tool.name in self._tools:
                raise ConfigError(f"tool {tool.name!r} is named twice")
            self._tools[tool.name] = tool
        self.schemas: list[dict] = [tool.schema for tool in self._tools.values()]
        self._pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="tool-call")

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    @property
    def sandbox_features(self) -> dict[str, str]:
        """What the python tool's sandbox got on this machine (namespaces, folder, uid, Landlock ABI); {} without
        the python tool. Worth logging once per run: the threat model depends on it (docs/tools.md)."""
        python = self._tools.get(PythonTool.name)
        return dict(python.features) if isinstance(python, PythonTool) else {}

    def call(self, call: ToolCall) -> ToolResult:
        """The result of one call; a failure of any kind is a result with ok=False, never an exception."""
        start = time.monotonic()
        try:
            result = self._checked_call(call)
        except Exception as error:  # a bug of a tool wrapper must not end the episode either
            result = failure("raised", f"error: {describe(error)}")
        return replace(result, seconds=time.monotonic() - start)

    def call_many(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """The results of `calls`, in their order, run at once (up to tools.workers)."""
        return list(self._pool.map(self.call, calls))

    def submit(self, call: ToolCall) -> Future:
        """Start `call` in the pool and return at once: a Future of its ToolResult (which never raises), so the
        caller can go on decoding other samples while the tool runs."""
        return self._pool.submit(self.call, call)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "ToolSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _checked_call(self, call: ToolCall) -> ToolResult:
        tool = self._tools.get(call.name) if isinstance(call.name, str) else None
        if tool is None:
            return failure("unknown_tool", f"error: there is no tool {str(call.name)[:80]!r}; the tools are "
                                           f"{', '.join(self._tools) or 'none'}")
        try:
            arguments = parse_arguments(call.arguments, self.config.max_argument_chars)
            check_arguments(arguments, tool.schema["function"]["parameters"])
        except ArgumentError as error:
            return failure(error.category, f"error: {error}")
        return tool.run(arguments)


def build_tool(spec: str, config: ToolsConfig):
    if isinstance(spec, str) and spec in CONFIGURED_TOOLS:
        return CONFIGURED_TOOLS[spec](config)
    name, function = resolve_tool(spec, built_in=tuple(CONFIGURED_TOOLS))
    return FunctionTool(name, function, config.timeout_s, config.max_output_chars)
