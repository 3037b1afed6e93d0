"""Functions a user names as "package.module:function" (reward functions, tools, agents): one reader for the
name's shape, the import (which runs the module's code, so anything can come out of it) and the check that the
name is a function. Each refusal is one line naming what to fix."""
from __future__ import annotations

import importlib
import re
from typing import Callable

from .errors import UserError

MODULE_FUNCTION = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def import_function(spec: str, what: str, error: type[UserError] = UserError) -> Callable:
    """The function `spec` ("package.module:function") names, for `what` (e.g. "reward function"); raises `error`
    naming the problem: a malformed name, a module that cannot be imported (or raised importing), no such
    function."""
    if not isinstance(spec, str) or not MODULE_FUNCTION.fullmatch(spec):
        raise error(f"{what} {str(spec)[:80]!r} must look like 'package.module:function'")
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as err:
        raise error(f"cannot import module {module_name!r} for {what} {spec!r}: {type(err).__name__}: "
                    f"{str(err)[:200]}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise error(f"module {module_name!r} has no function {name!r} ({what} {spec!r})")
    return function
