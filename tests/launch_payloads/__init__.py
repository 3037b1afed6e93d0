"""Small modules the launcher tests run on every rank (under torchrun, locally or in a Slurm job)."""
import os
from pathlib import Path

_TESTS = Path(__file__).parent.parent


def pythonpath() -> str:
    """PYTHONPATH under which the ranks import these payloads as well as the project itself."""
    return os.pathsep.join([str(_TESTS.parent), str(_TESTS), os.environ.get("PYTHONPATH", "")])
