"""Which implementation of the kernels runs for a device: the compiled module, or the PyTorch fallback.

All three expose the same functions (`logprob_partials`, `logprob_backward`, `gae`) with the same signatures;
the CPU module and the fallback also `rms_norm_forward` and `rms_norm_backward` (torch fuses RMSNorm on CUDA).
"""
import functools
import importlib
import os
import warnings
from types import ModuleType

import torch

from . import fallback

DISABLE_ENV_VAR = "VERL_MEGA_DISABLE_KERNELS"
COMPILED_MODULES = {"cpu": "verl_mega._kernels", "cuda": "verl_mega._kernels_cuda"}


def kernels_for(device: torch.device) -> ModuleType:
    # Read on every call (cheap) so that the switch also works after import, e.g. from a test.
    if os.environ.get(DISABLE_ENV_VAR, "0") not in ("", "0"):
        return fallback
    name = COMPILED_MODULES.get(device.type)
    module = _import_compiled(name) if name else None
    return module if module is not None else fallback


@functools.cache
def _import_compiled(name: str) -> ModuleType | None:
    """The compiled module, or None with a single warning per process and module."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        warnings.warn(
            f"{name} is not available ({err}); verl_mega.ops falls back to its PyTorch versions (ops/fallback.py), "
            "which are slower. Build the kernels with `pip install --no-build-isolation -e .` (see setup.py).",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
