"""The benchmarks (docs/benchmarks.md), each run as `python -m bench.NAME` from the repository's root."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def with_repo_on_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` with the repository's root on PYTHONPATH, for a bench's own module started as torchrun's ranks: they
    import nothing from the working folder (verl_mega.parallel.safe_path), and `bench` is not installed."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**(env or {}), "PYTHONPATH": path}
