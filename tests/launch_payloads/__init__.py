"""Small modules the launcher tests run on every rank (under torchrun, locally or in a Slurm job)."""
import os
from pathlib import Path

_TESTS = Path(__file__).parent.parent


def pythonpath() -> str:
    """PYTHONPATH under which the ranks import these payloads as well as the project itself (no empty entry,
    which would name the working folder)."""
    inherited = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    return os.pathsep.join([str(_TESTS.parent), str(_TESTS), *inherited])
