"""Tools a multi-turn rollout may call: the registry (plain functions, sync or async, by name or as
"module:function"), the built-ins (`calculator`, `python` in a sandbox) and ToolSet, which runs calls checked
against each tool's schema and contained, so a bad call is an error result and never an exception.

Layer 2: imports only config (the limits, ConfigError). docs/tools.md describes it, with the sandbox's threat
model."""
from . import calculator  # noqa: F401  (registers the calculator)
from .registry import TOOLS, register_tool, tool_schema
from .results import ERROR_CATEGORIES, ToolCall, ToolResult
from .toolset import ToolSet

__all__ = ["ERROR_CATEGORIES", "TOOLS", "ToolCall", "ToolResult", "ToolSet", "register_tool", "tool_schema"]
