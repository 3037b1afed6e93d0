"""Pick the rollout engine: vLLM where it can run (CUDA + vLLM importable), the embedded one otherwise."""
from __future__ import annotations

from pathlib import Path

import torch

from verl_mega.models.builder import DTYPES

from .embedded import EmbeddedEngine
from .vllm_engine import VLLMEngine

ENGINES = ("auto", "embedded", "vllm")
# vLLM's own name for each of our dtype names.
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_engine(engine: str) -> str:
    """`embedded` or `vllm`: what `engine` (auto, embedded, vllm) runs on this machine."""
    if engine not in ENGINES:
        raise ValueError(f"rollout.engine must be one of {', '.join(ENGINES)}, got '{engine}'")
    return "vllm" if engine == "vllm" or (engine == "auto" and vllm_usable()) else "embedded"


def resolve_rollout_dtype(engine: str, dtype: str, model_dtype: str) -> str:
    """The dtype the rollout engine runs and the HybridEngine streams: `dtype` unless `auto`, then bf16 for
    vLLM (what it serves fastest) and the model's own for the embedded engine (it generates with the very
    policy being trained)."""
    if dtype != "auto":
        return dtype
    return "bf16" if resolve_engine(engine) == "vllm" else model_dtype


def make_rollout_engine(engine: str, hf_dir: str | Path, hf_config: dict, *, rollout_tp: int = 1,
                        dtype: str = "fp32"):
    if resolve_engine(engine) == "vllm":
        return VLLMEngine(hf_dir, rollout_tp=rollout_tp, dtype=VLLM_DTYPES[dtype])
    if rollout_tp != 1:
        raise ValueError(f"the embedded rollout engine runs at rollout_tp=1 (got parallel.rollout_tp={rollout_tp}); "
                         "a larger rollout TP needs the vLLM engine on GPUs")
    return EmbeddedEngine(hf_config, dtype=DTYPES[dtype])
