"""Pick the rollout engine: vLLM where it can run (CUDA + vLLM importable), the embedded one otherwise."""
from __future__ import annotations

from pathlib import Path

import torch

from .embedded import EmbeddedEngine
from .vllm_engine import VLLMEngine

ENGINES = ("auto", "embedded", "vllm")


def vllm_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def make_rollout_engine(engine: str, hf_dir: str | Path, hf_config: dict, *, rollout_tp: int = 1,
                        dtype: torch.dtype = torch.float32):
    if engine not in ENGINES:
        raise ValueError(f"rollout.engine must be one of {', '.join(ENGINES)}, got '{engine}'")
    if engine == "vllm" or (engine == "auto" and vllm_usable()):
        return VLLMEngine(hf_dir, rollout_tp=rollout_tp)
    if rollout_tp != 1:
        raise ValueError(f"the embedded rollout engine runs at rollout_tp=1 (got parallel.rollout_tp={rollout_tp}); "
                         "a larger rollout TP needs the vLLM engine on GPUs")
    return EmbeddedEngine(hf_config, dtype=dtype)
