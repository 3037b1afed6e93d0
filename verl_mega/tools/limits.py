"""The ranges of tools.*: checked by the pre-flight check (every problem at once) and by ToolSet (the
first one), so the Python API and a run refuse the same values with the same words. The ranges themselves are
ToolsConfig's and PythonSandboxConfig's `RANGES` (below them a limit would refuse everything or could not start
an interpreter)."""
from __future__ import annotations

from verl_mega.config.ranges import out_of_range
from verl_mega.config.schema import ToolsConfig


def limit_problems(config: ToolsConfig) -> list[str]:
    """One message per out-of-range key of `config`, naming it as tools.KEY."""
    return list(out_of_range(config, "tools.").values())
