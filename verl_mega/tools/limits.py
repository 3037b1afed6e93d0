"""The ranges of tools.*: checked by the pre-flight check (every problem at once) and by ToolSet (the
first one), so the Python API and a run refuse the same values with the same words."""
from __future__ import annotations

from verl_mega.config.schema import ToolsConfig

# (key, smallest value): below it a limit would refuse everything or could not start an interpreter.
SMALLEST = (("max_output_chars", 1), ("max_argument_chars", 2), ("workers", 1), ("python.cpu_seconds", 1),
            ("python.memory_mb", 64), ("python.file_size_mb", 1), ("python.folder_mb", 1), ("python.open_files", 16),
            ("python.processes", 1))


def limit_problems(config: ToolsConfig) -> list[str]:
    """One message per out-of-range key of `config`, naming it as tools.KEY."""
    problems = [] if config.timeout_s > 0 else [f"tools.timeout_s must be > 0, got {config.timeout_s}"]
    for key, smallest in SMALLEST:
        value = config
        for part in key.split("."):
            value = getattr(value, part)
        if not isinstance(value, int) or value < smallest:
            problems.append(f"tools.{key} must be an integer >= {smallest}, got {value!r}")
    return problems
