"""int8 linear layers for the embedded engine's quantized rollouts (`rollout.quantization: int8`, CPU).

Each product is one s8 x s8 -> s32 GEMM in oneDNN, the kernel library torch ships for x86 CPUs, through torch's
own `torch._int_mm` (oneDNN's integer GEMM; torchao's int8 layers call the same operator). It reads the int8
weight as loaded, [out, in], transposed by its strides: nothing is reordered when the weights change, which the
HybridEngine's transition does every step. (oneDNN's `qlinear_prepack`, which its quantized-linear operators
need, reorders each weight into a blocked layout through a generic scalar reorder: 0.14 s a step for the ~100M
model's 84 linears, for GEMMs no faster than these.)

Weights: per-output-channel symmetric int8 with fp32 scales, as the HybridEngine streams them
(`quantization.quantize_int8`). Activations: quantized dynamically, per token (each row of the input its own
symmetric scale, computed on the fly). The int32 products are scaled back by the row's and the channel's scale.
The linears of one model share their last quantized input (`QuantizedInput`): q, k and v read the same hidden
states, as gate and up do, and quantize them once. At a decode step's 32 rows each quantization is about ten
small operations whose calls cost more than their arithmetic.
"""
from __future__ import annotations

import torch

from .quantization import quantize_int8


class QuantizedInput:
    """The input an `Int8Linear` quantized last, as int8 rows and their scales, for the next linear that reads
    the same tensor. A tensor changed in place since (its version counter moved) is quantized again."""

    def __init__(self):
        self._source: torch.Tensor | None = None
        self._version = -1
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 rows [tokens, in], fp32 scale per row) of `x` [..., in]."""
        if x is not self._source or x._version != self._version:
            self._rows = quantize_int8(x.reshape(-1, x.shape[-1]))
            self._source, self._version = x, x._version
        return self._rows


class Int8Linear(torch.nn.Module):
    """A linear layer whose weight is int8 per output channel.

    `weight` (int8 [out, in]) and `weight_scale` (fp32 [out]) are buffers under the checkpoint's names, so the
    engine loads the streamed tensors into them like any other; the bias, if any, stays a parameter in the
    engine's dtype. `inputs` is shared by the linears of one model (a layer of its own by default)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.nn.Parameter | None = None,
                 inputs: QuantizedInput | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.bias = bias
        self.inputs = inputs or QuantizedInput()

    @classmethod
    def replacing(cls, linear: torch.nn.Linear, inputs: QuantizedInput | None = None) -> "Int8Linear":
        return cls(linear.in_features, linear.out_features, linear.bias, inputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, row_scale = self.inputs.rows(x)
        out = torch._int_mm(q, self.weight.t()).float().mul_(row_scale[:, None]).mul_(self.weight_scale)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int8_linears(model: torch.nn.Module, quantized: callable) -> list[str]:
    """Replace, in place, every `torch.nn.Linear` whose weight name `quantized(name, weight)` accepts by an
    `Int8Linear`, all sharing one `QuantizedInput`; returns the replaced modules' names."""
    replaced, inputs = [], QuantizedInput()
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and quantized(f"{name}.weight", module.weight):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, Int8Linear.replacing(module, inputs))
            replaced.append(name)
    return replaced
