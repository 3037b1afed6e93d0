"""The default rollout engine on CPU: a transformers model generating with its KV cache, t_g = 1.

The model object is built once from the HF config; every transition copies the streamed tensors into its
parameters in place, so nothing is reloaded from disk and no new model is made per step. Where a tensor goes
is kept by parameter name and looked up in the live model at each load: moving the model between devices
(sleep and wake-up on a GPU) gives every parameter new storage, and a kept tensor would be the old one.

The stream carries checkpoint names (`block_sparse_moe.experts.3.w1.weight`); transformers 5 may hold
them fused in memory (`mlp.experts.gate_up_proj`). Where each checkpoint tensor lives inside the fused
parameters is learned once, by running transformers' own reverse conversion on tensors of element indices,
so no family knowledge is repeated here.

With `quantization="int8"` (`rollout.quantization`) the linear layers inside the transformer blocks become
`Int8Linear`s (oneDNN int8 GEMMs), whose int8 weights and scales the stream fills under their checkpoint names.
A quantized tensor aimed at a parameter kept in the engine's dtype (transformers' fused MoE experts) is
dequantized into it: the same values, run by an ordinary GEMM.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import torch

from verl_mega.data.padding import pad_rows
from verl_mega.models.builder import checkpoint_tensors
from verl_mega.parallel.shims import cuda_device_rewrite_paused

from .decode_attention import use_decode_attention
from .decoding import decode
from .engine import Response, RolloutEngine, SamplingParams
from .int8_linear import int8_linears
from .quantization import SCALE_SUFFIX, dequantize_int8, is_quantized_linear
from .routing import RouterRecorder


class EmbeddedEngine(RolloutEngine):
    records_routing = True  # through forward hooks on the transformers model's routers (`rollout.routing`)

    def __init__(self, raw_hf_config: dict, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device | None = None, quantization: str = "none"):
        from transformers import AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        config = CONFIG_MAPPING[raw_hf_config["model_type"]].from_dict(raw_hf_config)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(self.device).eval()
        if quantization not in ("none", "int8"):
            raise ValueError(f"the embedded rollout engine runs rollout.quantization none or int8, not {quantization}")
        if quantization == "int8":
            if self.device.type != "cpu":
                raise ValueError("the embedded engine's int8 rollout runs on CPU (oneDNN); on a GPU use "
                                 "rollout.engine=vllm with rollout.quantization=fp8")
            int8_linears(self.model, is_quantized_linear)
        use_decode_attention(self.model)
        self._targets = _checkpoint_targets(self.model)
        eos = config.eos_token_id
        self._eos = [eos] if isinstance(eos, int) else list(eos or [])
        self._pad = config.pad_token_id if config.pad_token_id is not None else (self._eos or [0])[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        loaded, params = set(), checkpoint_tensors(self.model)
        awaiting_scale: dict[str, torch.Tensor] = {}  # int8 weights bound for a parameter in the engine's dtype
        with torch.no_grad(), cuda_device_rewrite_paused():
            for name, tensor in weights:
                target = self._targets.get(name)
                if target is not None and tensor.dtype == torch.int8 and params[target.param_name].dtype != torch.int8:
                    awaiting_scale[name] = tensor.clone()  # the stream's tensor is valid until the next one
                    continue
                weight_name = name.removesuffix(SCALE_SUFFIX["int8"]) + "weight"
                if target is None and weight_name in awaiting_scale:
                    name, tensor = weight_name, dequantize_int8(awaiting_scale.pop(weight_name), tensor)
                    target = self._targets[name]
                if target is None:
                    raise KeyError(f"the embedded engine's model has no parameter '{name}' (is the stream for "
                                   f"this model family?)")
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"'{name}' arrives with shape {tuple(tensor.shape)} but the model holds "
                        f"{tuple(target.shape)}: the embedded engine needs full tensors (rollout_tp=1)"
                    )
                target.copy_(params[target.param_name], tensor)
                loaded.add(name)
        missing = sorted(set(self._targets) - loaded) + sorted(f"{name}'s scales" for name in awaiting_scale)
        if missing:
            raise ValueError(f"the weight stream lacked {len(missing)} parameters, e.g. {missing[:3]}")
        return len(loaded)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Response]:
        input_ids, attention_mask = self._left_padded(prompts)
        devices = [self.device] if self.device.type == "cuda" else []
        recorder = RouterRecorder(self.model) if params.routed_experts else None
        with (torch.no_grad(), torch.random.fork_rng(devices=devices), cuda_device_rewrite_paused(),
              recorder or contextlib.nullcontext()):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            decoded = decode(self.model, input_ids, attention_mask, params,
                             set(self._eos) | set(params.stop_token_ids), recorder)
        return [Response(row // params.n, tokens, None if decoded.logprobs is None else decoded.logprobs[row],
                         routed_experts=None if decoded.routed_experts is None else decoded.routed_experts[row])
                for row, tokens in enumerate(decoded.tokens)]

    def _left_padded(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and no empty prompt")
        ids, mask = pad_rows(prompts, self._pad, side="left")
        return ids.to(self.device), mask.to(self.device)

    def sleep(self, level: int = 1) -> None:
        # transformers keeps no KV cache between calls; on a GPU the weights wait on the host.
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        if self.device.type == "cuda" and (tags is None or "weights" in tags):
            self.model.to(self.device)


class _Target:
    """Where one checkpoint tensor lives in the parameter named `param_name`: a strided window, or scattered
    elements. Holds no parameter data, so it stays right when the parameter's storage is replaced."""

    def __init__(self, param_name: str, shape: torch.Size, stride: tuple[int, ...] | None, offset: int,
                 flat_index: torch.Tensor | None):
        self.param_name, self.shape, self.stride, self.offset = param_name, shape, stride, offset
        self.flat_index = flat_index

    def copy_(self, param: torch.Tensor, tensor: torch.Tensor) -> None:
        """Copy `tensor` into its place in `param`, the live parameter named `param_name`."""
        if self.flat_index is None:
            param.as_strided(self.shape, self.stride, self.offset).copy_(tensor)
        else:
            param.view(-1)[self.flat_index.to(param.device)] = tensor.reshape(-1).to(param.device, param.dtype)


def _checkpoint_targets(model: torch.nn.Module) -> dict[str, _Target]:
    """Checkpoint name -> its place in the model's parameters and saved buffers (DeepSeek-V3's expert-bias
    correction); the tied lm_head appears once, as embed_tokens."""
    targets = {}
    for name, param in checkpoint_tensors(model).items():
        checkpoint_name = _renamed_only(model, name, param)
        if checkpoint_name is None:
            targets.update(_probed_targets(model, name, param))
        else:
            targets[checkpoint_name] = _Target(name, param.shape, param.stride(), 0, None)
    return targets


def _renamed_only(model: torch.nn.Module, name: str, param: torch.Tensor) -> str | None:
    """The checkpoint name of a parameter that transformers' reverse conversion at most renames, else None.

    Most parameters are such. Probing each with an int64 index per element (twice over for its largest tensor)
    took 0.5 s and 200 MB of peak memory on a 100M model, growing with the model. A data-less (meta) stand-in
    coming back untouched (the same object, under one name) shows no data transform applies; a transform that
    fails on it is probed in full."""
    from transformers.core_model_loading import revert_weight_conversion

    stand_in = torch.empty(param.shape, device="meta")
    try:
        converted = revert_weight_conversion(model, {name: stand_in})
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None
    if len(converted) == 1 and next(iter(converted.values())) is stand_in:
        return next(iter(converted))
    return None


def _probed_targets(model: torch.nn.Module, name: str, param: torch.Tensor) -> dict[str, _Target]:
    """Where each checkpoint tensor made from `param` lives in it, learned from a tensor of element indices."""
    from transformers.core_model_loading import revert_weight_conversion

    probe = torch.arange(param.numel()).view(param.shape)
    return {checkpoint_name: _locate(name, param.numel(), index)
            for checkpoint_name, index in revert_weight_conversion(model, {name: probe}).items()}


def _locate(param_name: str, numel: int, index: torch.Tensor) -> _Target:
    """The target of a checkpoint tensor whose elements sit at `index` in the flat parameter of `numel`."""
    offset = int(index.reshape(-1)[0])
    stride = tuple(
        int(index.narrow(dim, 1, 1).reshape(-1)[0]) - offset if size > 1 else 1
        for dim, size in enumerate(index.shape)
    )
    last = offset + sum((size - 1) * step for size, step in zip(index.shape, stride))
    in_bounds = min(stride, default=0) >= 0 and last < numel
    if in_bounds and torch.equal(torch.arange(numel).as_strided(index.shape, stride, offset), index):
        return _Target(param_name, index.shape, stride, offset, None)
    return _Target(param_name, index.shape, None, 0, index.reshape(-1).clone())
