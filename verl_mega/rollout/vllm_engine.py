"""vLLM rollout on GPU: one engine per rank (external launcher), weights swapped in place each step.

Sequence per transition: `sleep()` after generating; before the next rollout `wake_up(["weights"])`,
`load_weights(hybrid.stream())`, `wake_up(["kv_cache"])`.

Two ways to feed weights:
- full tensors (`presliced=False`, HybridEngine at rollout_tp=1): vLLM's `load_weights` keeps its TP slice;
- pre-sliced (`presliced=True`, HybridEngine at rollout_tp = vLLM's TP): linear layers are marked as
  already sharded so vLLM's loaders stack q/k/v and gate/up without narrowing, and the vocabulary slice is
  written straight into the embedding / LM head, so no rank materialises a tensor it does not keep.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import torch

from .engine import Response, RolloutEngine, SamplingParams

NO_VLLM = ("the vLLM rollout engine needs vLLM on a CUDA machine (`pip install vllm`, GPU build of torch); "
           "on CPU use the embedded engine")


def import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise RuntimeError(f"{NO_VLLM} (import failed: {err})") from None
    return vllm


class VLLMEngine(RolloutEngine):
    def __init__(self, hf_dir: str | Path, *, rollout_tp: int = 1, presliced: bool = False,
                 rollout_tp_rank: int | None = None, vocab_rows: range | None = None, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.4, max_model_len: int | None = None, seed: int = 0,
                 load_format: str = "dummy"):
        """`rollout_tp_rank`: the HybridEngine's rollout TP rank, checked against vLLM's own; with
        `presliced`, `vocab_rows` is `rollout_vocab_rows(...)` of this rank (the rows its slice holds)."""
        vllm = import_vllm()
        if not torch.cuda.is_available():
            raise RuntimeError(f"{NO_VLLM}: no CUDA device is visible")
        # The external launcher keeps the engine in this torchrun process, its TP group among its peers.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.llm = vllm.LLM(
            model=str(hf_dir), tensor_parallel_size=rollout_tp, distributed_executor_backend="external_launcher",
            enable_sleep_mode=True, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, seed=seed, load_format=load_format,
        )
        self._vllm = vllm
        self.presliced = presliced
        self.vocab_rows = vocab_rows
        if rollout_tp_rank is not None:
            from vllm.distributed import get_tensor_model_parallel_rank

            if get_tensor_model_parallel_rank() != rollout_tp_rank:
                raise RuntimeError(
                    f"vLLM placed this rank at TP rank {get_tensor_model_parallel_rank()} but the HybridEngine "
                    f"regrouped weights for rollout TP rank {rollout_tp_rank}: vLLM's external launcher groups "
                    "consecutive ranks, so use rollout_tp equal to the training TP (or 1 with full tensors)"
                )
        if presliced and vocab_rows is None:
            raise ValueError("presliced=True needs vocab_rows (HybridEngine: rollout_vocab_rows of this rank)")

    def model(self) -> torch.nn.Module:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        model = self.model()
        if not self.presliced:
            return len(model.load_weights(weights))
        return len(model.load_weights(self._presliced(model, weights)))

    def _presliced(self, model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]):
        """Mark linear weights as already sharded; write vocabulary slices in place, pass the rest on."""
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        vocab_layers = {}
        for module_name, module in model.named_modules():
            if isinstance(module, LinearBase):
                for param in module.parameters(recurse=False):
                    param.is_sharded_weight = True
            elif isinstance(module, VocabParallelEmbedding):
                vocab_layers[module_name] = module
        for name, tensor in weights:
            layer = next((m for prefix, m in vocab_layers.items() if name == f"{prefix}.weight"), None)
            if layer is None:
                yield name, tensor
                continue
            indices = layer.shard_indices
            if (indices.org_vocab_start_index, indices.org_vocab_end_index) != (self.vocab_rows.start,
                                                                                 self.vocab_rows.stop):
                raise RuntimeError(
                    f"vLLM's vocabulary slice of '{name}' is rows {indices.org_vocab_start_index}:"
                    f"{indices.org_vocab_end_index}, the regrouped one {self.vocab_rows.start}:{self.vocab_rows.stop}"
                    ": feed full tensors (presliced=False) for this model"
                )
            with torch.no_grad():
                layer.weight.data[: tensor.shape[0]].copy_(tensor)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Response]:
        sampling = self._vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids), seed=params.seed,
            logprobs=0 if params.logprobs else None,
        )
        requests = [{"prompt_token_ids": list(prompt)} for prompt in prompts]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        responses = []
        for index, output in enumerate(outputs):
            for sample in output.outputs:
                logprobs = None
                if params.logprobs:
                    logprobs = [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
                responses.append(Response(index, list(sample.token_ids), logprobs))
        return responses

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.llm.wake_up(tags=list(tags) if tags is not None else None)
