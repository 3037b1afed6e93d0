"""The megatron-core releases verl_mega supports, and what differs between them, in one table.

verl_mega reaches into megatron-core's internals (its dist-checkpoint readers, the CUDA corners `shims.py`
patches on CPU), so it is tested against a range of releases, SUPPORTED, and refuses any other at import
(`check_installed`). Inside the range, code whose megatron-core internal changed asks `since(CHANGE)` instead of
comparing version numbers itself: CHANGES names each such internal, the first release that has the new form, and
a probe that tells the two forms apart, which tests/test_megatron_versions.py checks against the release
installed (CI runs it on the lowest and the newest supported release).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# The lowest supported release and the first unsupported one.
SUPPORTED = ((0, 16, 1), (0, 20, 0))
PINNED = "0.16.1"  # requirements.txt's, which CI runs everything on


@dataclass(frozen=True)
class Change:
    """One megatron-core internal verl_mega uses that changed inside SUPPORTED."""

    first_release: tuple[int, int, int]
    what: str  # the old and the new form, and what verl_mega does about it
    probe: Callable[[], bool]  # True where the installed megatron-core has the new form


def _has(module: str, name: str) -> bool:
    return hasattr(importlib.import_module(module), name)


def _source_of(module: str) -> str:
    """A module's source as the release ships it (0.17+ name te_general_gemm in the import and in the fallback)."""
    return Path(importlib.util.find_spec(module).origin).read_text()


CHANGES = {
    "common_state_reader_is_a_function": Change(
        (0, 17, 0),
        "dist_checkpointing reads common.pt in strategies.common.load_common, a function that serialization "
        "imports by name (0.16: the method TorchCommonLoadStrategy.load_common); checkpoint/safe_unpickle.py "
        "guards whichever exists",
        lambda: not _has("megatron.core.dist_checkpointing.strategies.common", "TorchCommonLoadStrategy"),
    ),
    "moe_utils_defines_te_general_gemm": Change(
        (0, 17, 0),
        "without transformer-engine, moe_utils sets te_general_gemm to None (0.16 leaves it undefined, and the "
        "router's GEMM raises NameError): parallel/shims.py defines it on 0.16 only",
        # The module's source, not its attributes: on 0.16 parallel/shims.py has defined it by the time this runs.
        lambda: _source_of("megatron.core.transformer.moe.moe_utils").count("te_general_gemm,") >= 2,
    ),
    "router_compiles_at_import": Change(
        (0, 17, 0),
        "the MoE router decorates one method with torch.compile itself, not through jit_fuser (0.16: none), so "
        "importing megatron-core imports torch's compiler stack whatever parallel/deferred_compile.py defers",
        lambda: "@torch.compile\n" in _source_of("megatron.core.transformer.moe.router"),
    ),
}


def release_of(found: str) -> tuple[int, int, int] | None:
    """The release numbers a version string starts with ("0.19.0rc1+nv25.10" -> (0, 19, 0)), None if none."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", found)
    return tuple(int(part or 0) for part in match.groups()) if match else None


def supported_range() -> str:
    """SUPPORTED as a pip specifier: '>=0.16.1,<0.20'."""
    lowest, first_unsupported = SUPPORTED
    return f">={'.'.join(map(str, lowest))},<{first_unsupported[0]}.{first_unsupported[1]}"


def check_installed() -> None:
    """Refuses, with one line naming the supported range, a missing megatron-core or one outside SUPPORTED."""
    found = _installed_version()
    release = release_of(found) if found else None
    lowest, first_unsupported = SUPPORTED
    if release is None or not lowest <= release < first_unsupported:
        raise ImportError(f"verl_mega supports megatron-core {supported_range()} (found {found or 'none'}): "
                          f"pip install 'megatron-core=={PINNED}' (the release CI pins) or another in that range")


def since(change: str) -> bool:
    """Whether the installed megatron-core has CHANGES[change]'s new form."""
    return installed_release() >= CHANGES[change].first_release


@functools.cache
def installed_release() -> tuple[int, int, int]:
    return release_of(version("megatron-core"))  # check_installed ran at `import verl_mega`


def _installed_version() -> str | None:
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None
