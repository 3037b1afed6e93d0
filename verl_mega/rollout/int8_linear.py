"""int8 linear layers for the embedded engine's quantized rollouts (`rollout.quantization: int8`, CPU).

The products run in oneDNN, the kernel library torch ships for x86 CPUs, through torch's own operators
`onednn::qlinear_prepack` (the weight reordered once per load into oneDNN's blocked int8 layout) and
`onednn::qlinear_pointwise` (an s8 x s8 -> s32 GEMM with the scales applied on the way out): the path
torch.compile's x86 int8 quantization lowers to. They take plain int8 tensors and scale tensors; the older
`quantized::linear_dynamic` (FBGEMM) route needs torch's quantized tensor types, whose constructors torch 2.13
deprecates.

Weights: per-output-channel symmetric int8 with fp32 scales, as the HybridEngine streams them
(`quantization.quantize_int8`). Activations: quantized dynamically, per token (each row of the input its own
symmetric scale, computed on the fly): the GEMM runs with an activation scale of 1 and each output row is
multiplied by its input row's scale after it, which oneDNN's single activation scale could not express.
"""
from __future__ import annotations

import torch

from .quantization import quantize_int8


class Int8Linear(torch.nn.Module):
    """A linear layer whose weight is int8 per output channel; `pack()` after the weight and scales are loaded.

    `weight` (int8 [out, in]) and `weight_scale` (fp32 [out]) are buffers under the checkpoint's names, so the
    engine loads the streamed tensors into them like any other; the bias, if any, stays a parameter in the
    engine's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: torch.nn.Parameter | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))
        self.register_buffer("_zero_points", torch.zeros(out_features, dtype=torch.int32), persistent=False)
        self.bias = bias
        self._packed: torch.Tensor | None = None

    @classmethod
    def replacing(cls, linear: torch.nn.Linear) -> "Int8Linear":
        return cls(linear.in_features, linear.out_features, linear.bias)

    def pack(self) -> None:
        """Reorder the loaded int8 weight for oneDNN (once per weight load, not per call)."""
        self._packed = torch.ops.onednn.qlinear_prepack(self.weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            raise RuntimeError("Int8Linear runs before its weights were loaded (pack() after load)")
        rows = x.reshape(-1, self.in_features)
        q, row_scale = quantize_int8(rows)
        out = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, self._packed, self.weight_scale, self._zero_points,
                                                 None, 1.0, 0, torch.float32, "none", [], "")
        out = out * row_scale[:, None]
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int8_linears(model: torch.nn.Module, quantized: callable) -> list[str]:
    """Replace, in place, every `torch.nn.Linear` whose weight name `quantized(name, weight)` accepts by an
    `Int8Linear`; returns the replaced modules' names."""
    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and quantized(f"{name}.weight", module.weight):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, Int8Linear.replacing(module))
            replaced.append(name)
    return replaced
