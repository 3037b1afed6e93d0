"""LoRA adapters on megatron-core's linear layers, tensor-parallel the way their base layer is.

`apply_lora` registers two parameters on each targeted linear module itself, `lora_a` [rank, in_local] and
`lora_b` [out_local, rank], next to its frozen `weight` (whose name, and so every converter, checkpoint and
HybridEngine path, stays as it was), and a forward hook that adds scale * B(A(dropout(x))) to the module's
output, scale = alpha / rank.

Tensor parallelism follows the base layer:
- column-parallel (linear_qkv, linear_fc1; output split): A is replicated [rank, in], B is split with the
  output [out/tp, rank]; megatron's copy_to_tensor_model_parallel_region between A and B sums A's gradient
  over the TP ranks, as the base layer's own input copy does for x.
- row-parallel (linear_proj, linear_fc2; input split): A is split with the input [rank, in/tp] and the partial
  A_local x_local are summed over TP (reduce_from_tensor_model_parallel_region); B is replicated [out, rank].
Fused layouts (q/k/v interleaved per query group, gate/up) need nothing: B's rows are the base weight's output
rows in megatron's layout.

A is drawn for the whole (TP-merged) matrix from a generator seeded by the layer's global name, then sliced,
so every layout starts from the same adapters; B starts at zero, so the first forward is the base model's.

Dropout on the adapters' input is drawn as megatron draws its own: a column-parallel layer's input is replicated
over TP, so every TP rank draws the same mask from the generator they share (as megatron's hidden dropout);
a row-parallel layer's input is split, so each rank draws its slice's mask from megatron's model-parallel RNG
tracker (seeded per TP rank, as megatron's attention dropout; an expert's from the experts' tracker).
Together the ranks' masks are then one mask of the whole input drawn independently per element, as at TP 1.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from verl_mega.config.ranges import out_of_range
from verl_mega.config.schema import LORA_INITS, LORA_TARGETS, LoraConfig

from .builder import unwrap_model
from .chunks import StageChunks
from .expected_shapes import mcore_shape
from .hf_config import HFModelConfig
from .spec import FamilySpec, TensorRule

COLUMN, ROW = "column", "row"
LORA_PARAMETER_NAMES = ("lora_a", "lora_b")
# transformer-engine's linear layers (the GPU layer spec), known by name: the module is imported only where
# transformer-engine is installed.
_TE_MODULE = "megatron.core.extensions.transformer_engine"
_TE_KINDS = {"TELayerNormColumnParallelLinear": COLUMN, "TEColumnParallelLinear": COLUMN,
             "TERowParallelLinear": ROW}
# MoE experts computed as one grouped GEMM hold every expert's weights in one parameter: no linear to adapt.
_GROUPED_EXPERTS = ("GroupedMLP", "TEGroupedMLP")


@dataclass(frozen=True)
class LoraModuleInfo:
    """One adapted module: its name in the (unwrapped) GPTModel on this rank, its parallel kind (`column` or
    `row`) and the scale alpha / rank of its adapters' output."""

    name: str
    kind: str
    scale: float


def lora_scale(config: LoraConfig) -> float:
    """alpha / rank, alpha defaulting to 2 x rank."""
    alpha = 2.0 * config.rank if config.alpha is None else config.alpha
    return alpha / config.rank


def config_problems(config: LoraConfig, key: str) -> list[str]:
    """What is wrong with `config` on its own (the model's shapes aside), one line per problem naming `key`."""
    problems = list(out_of_range(config, f"{key}.").values())
    unknown = [target for target in config.targets if target not in LORA_TARGETS]
    if unknown:
        problems.append(f"{key}.targets: {', '.join(map(str, unknown))} unknown; known: {', '.join(LORA_TARGETS)}")
    if not config.targets and config.rank:
        problems.append(f"{key}.targets is empty: name at least one of {', '.join(LORA_TARGETS)}")
    if config.init not in LORA_INITS:
        problems.append(f"{key}.init '{config.init}' is unknown; known: {', '.join(LORA_INITS)}")
    return problems


def model_problems(config: LoraConfig, key: str, hf_config: HFModelConfig, family: FamilySpec, tp: int) -> list[str]:
    """What `config` cannot do on this model at tensor-parallel size `tp`: targets the family has no layer of, and
    a rank wider than the narrowest targeted shard (the check `apply_lora` makes on the built model)."""
    if not config.rank:
        return []
    rules = {target: [rule for rule in family.active_rules(hf_config) if _targets(rule, target)]
             for target in config.targets if target in LORA_TARGETS}
    problems = [f"{key}.targets: {target}: the {family.name} family has no such layer; drop it from the targets"
                for target, found in rules.items() if not found]
    shards = [(rule.mcore, _shard_shape(rule, hf_config, tp)) for found in rules.values() for rule in found]
    if shards:
        name, (rows, columns) = min(shards, key=lambda shard: min(shard[1]))
        if config.rank > min(rows, columns):
            problems.append(f"{key}.rank={config.rank} does not fit {name} ({rows} x {columns} on each of "
                            f"parallel.tp={tp} ranks): use a rank of at most {min(rows, columns)}")
    return problems


def _targets(rule: TensorRule, target: str) -> bool:
    return rule.mcore.endswith(f".{target}.weight")


def _shard_shape(rule: TensorRule, hf_config: HFModelConfig, tp: int) -> tuple[int, int]:
    shape = list(mcore_shape(rule, hf_config))
    if rule.tp_dim is not None:
        shape[rule.tp_dim] //= tp
    return shape[0], shape[1]


def parallel_kind(module) -> str | None:
    """`column` or `row` for a megatron (or transformer-engine) tensor-parallel linear layer, else None."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return COLUMN
    if isinstance(module, RowParallelLinear):
        return ROW
    # A subclass of transformer-engine's (Gemma-2's post-normed row-parallel linear) is of its kind.
    return next((_TE_KINDS[cls.__name__] for cls in type(module).__mro__
                 if cls.__module__.startswith(_TE_MODULE) and cls.__name__ in _TE_KINDS), None)


class _Adapter:
    """The forward hook of one adapted module: output + scale * B(A(dropout(x))), in the TP split of `kind`."""

    def __init__(self, kind: str, scale: float, dropout: float):
        self.kind, self.scale, self.dropout = kind, scale, dropout
        self.enabled = True

    def __call__(self, module, args, kwargs, output):
        if not self.enabled:
            return None
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
        )

        # The input, however the layer was called (megatron's linears name it `input_`, transformer-engine's `x`).
        x = adapter_input(module, args[0] if args else kwargs.get("input_", kwargs.get("x")))
        if self.dropout and module.training:
            x = self.dropped(module, x)
        low_rank = F.linear(x, module.lora_a)
        group = getattr(module, "tp_group", None)
        if self.kind == COLUMN:
            low_rank = copy_to_tensor_model_parallel_region(low_rank, group=group)
        else:
            low_rank = reduce_from_tensor_model_parallel_region(low_rank, group=group)
        out, bias = output
        # One GEMM that also scales and adds to the output: out + scale * low_rank B^T. The separate scale and sum
        # were two passes over the layer's whole output and a temporary of its size (about 0.4 s, 4 %, of a LoRA
        # GRPO step's CPU time on the ~100M model: docs/lora.md).
        update = torch.addmm(out.reshape(-1, out.shape[-1]), low_rank.reshape(-1, low_rank.shape[-1]),
                             module.lora_b.t(), alpha=self.scale)
        return update.view(out.shape), bias

    def dropped(self, module, x: torch.Tensor) -> torch.Tensor:
        """`x` through dropout, its mask drawn by the rule of the module docstring."""
        if self.kind == COLUMN:  # replicated input: the generator every TP rank shares draws one mask
            return F.dropout(x, self.dropout)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        tracker = get_cuda_rng_tracker()
        split_rng = (tracker.fork(get_expert_parallel_rng_tracker_name()) if getattr(module, "is_expert", False)
                     else tracker.fork())
        with split_rng:
            return F.dropout(x, self.dropout)


def adapter_input(module, x: torch.Tensor) -> torch.Tensor:
    """What the base GEMM multiplies: `x` itself, or for transformer-engine's norm-fused linear
    (TELayerNormColumnParallelLinear: the pre-attention and pre-MLP norm inside linear_qkv / linear_fc1) `x`
    normalised as it normalises it (in fp32, back to x's dtype)."""
    weight = getattr(module, "layer_norm_weight", None)
    if weight is None:
        return x
    gamma = weight.float() + 1 if getattr(module, "zero_centered_gamma", False) else weight.float()
    shape = (x.shape[-1],)
    if module.normalization == "RMSNorm":
        normed = F.rms_norm(x.float(), shape, gamma, module.eps)
    else:
        bias = module.layer_norm_bias
        normed = F.layer_norm(x.float(), shape, gamma, None if bias is None else bias.float(), module.eps)
    return normed.to(x.dtype)


def _group_size_and_rank(module) -> tuple[int, int]:
    """The size of the module's tensor-parallel group (the experts' own for an expert's linear) and this rank's
    place in it."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = getattr(module, "tp_group", None)
    if group is None:
        expert = getattr(module, "is_expert", False)
        group = (parallel_state.get_expert_tensor_parallel_group() if expert
                 else parallel_state.get_tensor_model_parallel_group())
    return dist.get_world_size(group), dist.get_rank(group)


def initial_a(config: LoraConfig, in_features: int, seed_name: str) -> torch.Tensor:
    """The whole (TP-merged) A [rank, in_features] in fp32, drawn from a generator seeded by `seed_name`."""
    generator = torch.Generator().manual_seed(zlib.crc32(seed_name.encode()))
    if config.init == "gaussian":
        return torch.randn(config.rank, in_features, generator=generator) / config.rank
    # PEFT's kaiming_uniform_(a=sqrt(5)): bound = gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in).
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(config.rank, in_features, generator=generator) * 2 - 1) * bound


def _add_adapters(module, kind: str, config: LoraConfig, seed_name: str) -> None:
    """Register lora_a / lora_b on `module` in its TP split, tagged as megatron tags its weight."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    weight = module.weight
    out_local, in_local = weight.shape
    tp, tp_rank = _group_size_and_rank(module)
    if kind == COLUMN:
        a = initial_a(config, in_local, seed_name)
    else:
        a = initial_a(config, in_local * tp, seed_name)[:, tp_rank * in_local:(tp_rank + 1) * in_local]
    module.lora_a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    module.lora_b = torch.nn.Parameter(torch.zeros(out_local, config.rank, device=weight.device, dtype=weight.dtype))
    split, split_dim = (module.lora_b, 0) if kind == COLUMN else (module.lora_a, 1)
    set_tensor_model_parallel_attributes(split, is_parallel=True, dim=split_dim, stride=1)
    # An expert's parameters are reduced over the expert data-parallel group, not the dense one.
    allreduce = getattr(weight, "allreduce", None)
    if allreduce is not None:
        for param in (module.lora_a, module.lora_b):
            param.allreduce = allreduce


def apply_lora(model, config: LoraConfig) -> None:
    """Freeze every parameter of `model` (a GPTModel, or its wrappers) and add adapters to the linear layers
    `config.targets` names; nothing with rank 0. Raises a one-line ValueError for a config it cannot apply."""
    if not config.rank:
        return
    problems = config_problems(config, "lora")
    if problems:
        raise ValueError(problems[0])
    root = unwrap_model(model)
    targets = _targeted_modules(root, config)
    if not targets:
        raise ValueError(f"lora.targets: the model has none of {', '.join(config.targets)}")
    for name, module, _ in targets:  # every refusal before anything changes
        _check_fit(name, module, config)
    root.requires_grad_(False)
    scale = lora_scale(config)
    for name, module, kind in targets:
        _add_adapters(module, kind, config, global_name(root, name))
        module._lora = _Adapter(kind, scale, config.dropout)
        module._lora_info = LoraModuleInfo(name, kind, scale)
        # First among the module's hooks: the update adds to the linear's own output (Gemma-2's post-normed
        # linears normalise it in a hook of their own).
        module.register_forward_hook(module._lora, with_kwargs=True, prepend=True)


def _check_fit(name: str, module, config: LoraConfig) -> None:
    if getattr(module, "sequence_parallel", False):
        raise ValueError(f"lora: {name} runs with sequence parallelism, which the adapters do not support")
    out_local, in_local = module.weight.shape
    largest_rank = min(out_local, in_local)
    if config.rank > largest_rank:
        raise ValueError(f"lora.rank={config.rank} does not fit {name} ({out_local} x {in_local} on each of "
                         f"{_group_size_and_rank(module)[0]} TP ranks): use a rank of at most {largest_rank}")


def _targeted_modules(root, config: LoraConfig) -> list[tuple[str, torch.nn.Module, str]]:
    """(name, module, kind) of every linear layer named by a target; refuses what cannot take adapters."""
    targets = []
    fc_targeted = {"linear_fc1", "linear_fc2"} & set(config.targets)
    for name, module in root.named_modules():
        if fc_targeted and type(module).__name__ in _GROUPED_EXPERTS:
            raise ValueError(f"lora.targets: {name} computes its experts as one grouped GEMM (moe_grouped_gemm), "
                             f"which takes no adapters; drop {', '.join(sorted(fc_targeted))} from the targets")
        if name.rpartition(".")[2] not in config.targets:
            continue
        kind = parallel_kind(module)
        if kind is None:
            raise ValueError(f"lora.targets: {name} is a {type(module).__name__}, not a megatron linear layer")
        if hasattr(module, "_lora"):
            raise ValueError(f"lora: {name} has adapters already")
        targets.append((name, module, kind))
    return targets


def global_name(root, name: str) -> str:
    """`name` with its layer (and expert) index made global and without a model chunk's `chunks.C.`: the same
    module at every pipeline (virtual stage and expert) layout gets the same name, so its adapters start from the
    same draw."""
    parts, module, out = name.split("."), root, []
    for previous, part in zip([None, *parts], parts):
        module = module._modules[part]
        if previous == "layers" and hasattr(module, "layer_number"):
            part = str(module.layer_number - 1)
        elif previous == "local_experts":
            part = str(_global_expert(root, int(part)))
        out.append(part)
    return ".".join(out[2:] if isinstance(root, StageChunks) else out)


def _global_expert(root, local: int) -> int:
    from megatron.core import parallel_state

    config = root.config
    local_experts = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * local_experts + local


def lora_modules(model) -> list[LoraModuleInfo]:
    """The adapted modules of `model` on this rank, in module order."""
    return [module._lora_info for module in unwrap_model(model).modules() if hasattr(module, "_lora_info")]


def lora_parameters(model) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every adapter matrix on this rank, named as in the unwrapped GPTModel
    (`decoder.layers.0.self_attention.linear_qkv.lora_a`)."""
    for name, param in unwrap_model(model).named_parameters():
        if name.rpartition(".")[2] in LORA_PARAMETER_NAMES:
            yield name, param


def has_lora(model) -> bool:
    return any(True for _ in lora_parameters(model))


@contextlib.contextmanager
def adapters_disabled(model):
    """Within it, `model`'s forward is the base model's, bitwise (the hooks add nothing): the reference policy."""
    adapters = [module._lora for module in unwrap_model(model).modules() if hasattr(module, "_lora")]
    states = [adapter.enabled for adapter in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, state in zip(adapters, states):
            adapter.enabled = state


def merged_weight(weight_local: torch.Tensor, a_local: torch.Tensor, b_local: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """W + scale * B @ A for one TP shard (a column layer's B shard and whole A, or a row layer's whole B and A
    shard), computed in fp32, returned in W's dtype. In place in one fp32 buffer: the HybridEngine's transition,
    the final weights and the export hold one shard-sized tensor for it (plus the cast copy for a narrower W),
    where the out-of-place expression holds three or four."""
    merged = b_local.float() @ a_local.float()
    merged.mul_(scale).add_(weight_local)
    return merged.to(weight_local.dtype)
