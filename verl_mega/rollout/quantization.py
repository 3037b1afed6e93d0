"""Low-precision rollout weights (`rollout.quantization`): the quantizers, as pure tensor functions, and the
rewrite of the HybridEngine's stream that applies them.

The training weights keep their dtype; the rollout engine receives, for each linear layer's weight, the
quantized tensor under the weight's own name and its scales beside it:

- int8: per-output-channel symmetric, `W ~= q * weight_scale[:, None]`, `q` int8 in [-127, 127] and
  `weight_scale` fp32 [out] (the name compressed-tensors and vLLM give a channel scale). The rounding error of
  an element is at most half its row's scale, amax(|row|) / 254.
- fp8: block-wise float8_e4m3fn over 128 x 128 blocks, DeepSeek-V3's layout: `W ~= q * weight_scale_inv`
  broadcast over each block, `weight_scale_inv` fp32 [ceil(out / 128), ceil(in / 128)] (despite the name, the
  multiplier that dequantizes, as in DeepSeek-V3's checkpoints and vLLM's `Fp8LinearMethod`). A block's
  largest magnitude maps to e4m3's largest, 448; e4m3 keeps 3 mantissa bits, so an element's error is at most
  2**-4 of its magnitude, or 2**-10 of the block's scale below e4m3's smallest normal (subnormals).

What is quantized: the 2-D weights of the linear layers inside the transformer blocks (attention and MLP
projections, experts included). Embeddings, the LM head, norms and MoE routers keep the rollout dtype, as in
DeepSeek-V3's FP8 checkpoints and vLLM's FP8 models (an error in the router changes which experts run; one in
the vocabulary rows moves every log-prob).
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Iterator

import torch

FORMATS = ("none", "int8", "fp8")
INT8_MAX = 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size [128, 128]
SCALE_SUFFIX = {"int8": "weight_scale", "fp8": "weight_scale_inv"}
# Relative rounding bound of a normal e4m3 value (3 mantissa bits: half a unit in the last place) and the absolute
# one, in units of the block's scale, below its smallest normal 2**-6 (subnormal spacing 2**-9).
FP8_RELATIVE_ERROR = 2.0 ** -4
FP8_SUBNORMAL_ERROR = 2.0 ** -10

# HF names of linear layers' projections across the families: q/k/v/o, gate/up/down, fused qkv / gate_up
# (Phi-3), DeepSeek-V3's q_a/q_b/kv_a_proj_with_mqa/kv_b, and Mixtral's experts (w1, w2, w3).
_LINEAR = re.compile(r"\.layers\.\d+\..*(_proj|_proj_with_mqa|\.w[123])\.weight$")


def is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    """Whether the rollout receives this HF tensor quantized: a 2-D projection weight inside a layer."""
    return is_quantized_linear_shape(name, tensor.shape)


def is_quantized_linear_shape(name: str, shape) -> bool:
    """`is_quantized_linear` from the tensor's name and shape alone (the planner has no tensors)."""
    return len(shape) == 2 and _LINEAR.search(name) is not None


def scale_name(name: str, fmt: str) -> str:
    """The name of `name`'s scale tensor in format `fmt` (`...q_proj.weight` -> `...q_proj.weight_scale_inv`)."""
    return name.removesuffix("weight") + SCALE_SUFFIX[fmt]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale fp32 [out]) with weight ~= q * scale[:, None]. A row of zeros gets scale 1 (any
    scale dequantizes its zeros exactly; 0 would divide by zero)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    # |w / scale| <= 127 up to a rounding of the division, which round() absorbs: no clamp is needed. This runs on
    # every activation of the int8 rollout, where each operation's call costs more than its arithmetic.
    q = torch.round(w / scale[:, None]).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def int8_error_bound(weight: torch.Tensor) -> torch.Tensor:
    """Per element, the most |weight - dequantize(quantize(weight))| may be: half its row's scale."""
    _, scale = quantize_int8(weight)
    return (scale / 2)[:, None].expand(weight.shape)


def quantize_fp8_block(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [out, in], scale_inv fp32 [ceil(out/block), ceil(in/block)]) with weight ~= q * scale_inv
    over each block. Shapes that are not multiples of `block` have smaller last blocks (zero-padded while their
    amax is taken, as DeepSeek-V3's quantizer does); an all-zero block gets scale 1."""
    w = weight.detach().float()
    rows, cols = w.shape
    amax = _block_view(_padded(w.abs(), block), block).amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expanded(scale_inv, block, rows, cols)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    return q.float() * _expanded(scale_inv, block, *q.shape)


def fp8_error_bound(weight: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Per element, the most |weight - dequantize(quantize(weight))| may be (see the module docstring)."""
    _, scale_inv = quantize_fp8_block(weight, block)
    scale = _expanded(scale_inv, block, *weight.shape)
    return torch.maximum(weight.detach().float().abs() * FP8_RELATIVE_ERROR, scale * FP8_SUBNORMAL_ERROR)


def quantize(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized weight and its scales in format `fmt` (int8 or fp8)."""
    if fmt == "int8":
        return quantize_int8(weight)
    if fmt == "fp8":
        return quantize_fp8_block(weight)
    raise ValueError(f"rollout.quantization '{fmt}' is unknown; known: {', '.join(FORMATS)}")


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight a quantized tensor and its scales stand for (the format read from q's dtype)."""
    return dequantize_int8(q, scale) if q.dtype == torch.int8 else dequantize_fp8_block(q, scale)


def quantized_stream(stream: Iterable[tuple[str, torch.Tensor]], fmt: str,
                     dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`stream` with each linear weight replaced by its quantized tensor, followed at once by its scales; the
    other tensors cast to `dtype` (None: as they are). Quantizes from the tensor as streamed (its training
    dtype), one at a time."""
    for name, tensor in stream:
        if fmt != "none" and is_quantized_linear(name, tensor):
            q, scale = quantize(tensor, fmt)
            yield name, q
            yield scale_name(name, fmt), scale
        else:
            yield name, tensor if dtype is None else tensor.to(dtype)


def quantized_weight_bytes(shape: tuple[int, ...], fmt: str) -> int:
    """Bytes a linear weight of `shape` takes in the rollout in format `fmt` (the 1-byte values and fp32 scales)."""
    rows, cols = shape
    if fmt == "int8":
        return rows * cols + 4 * rows
    return rows * cols + 4 * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)


def _padded(w: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = w.shape
    return torch.nn.functional.pad(w, (0, -cols % block, 0, -rows % block))


def _block_view(w: torch.Tensor, block: int) -> torch.Tensor:
    """[rows/block, block, cols/block, block] view of a padded matrix."""
    rows, cols = w.shape
    return w.view(rows // block, block, cols // block, block)


def _expanded(scale: torch.Tensor, block: int, rows: int, cols: int) -> torch.Tensor:
    """Each block's scale repeated over its elements, cut to [rows, cols]."""
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
