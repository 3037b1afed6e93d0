"""The low-precision rollout's quantizers (verl_mega.rollout.quantization): each format's error bound on random
and real-shaped weights, its edge cases, and the stream rewrite."""
import math

import pytest
import torch

from verl_mega.rollout.quantization import (
    FP8_BLOCK, dequantize, fp8_error_bound, int8_error_bound, is_quantized_linear, quantize, quantized_stream,
    quantized_weight_bytes, scale_name,
)

BOUNDS = {"int8": int8_error_bound, "fp8": fp8_error_bound}
# Real-shaped slices: SmolLM-135M's gate_proj (576 x 1536) and Llama-7B's up_proj rows (4096 x 11008, a slice).
SHAPES = [(576, 1536), (1536, 576), (512, 11008), (4096, 384), (130, 200), (1, 7)]


def _within_bound(weight: torch.Tensor, fmt: str) -> None:
    q, scale = quantize(weight, fmt)
    error = (dequantize(q, scale) - weight.float()).abs()
    bound = BOUNDS[fmt](weight)
    # fp32 arithmetic of the division and product adds at most a few ulps of the value.
    slack = weight.float().abs() * 1e-6 + 1e-12
    worst = (error - bound - slack).max().item()
    assert worst <= 0, f"{fmt} {tuple(weight.shape)}: an element is {worst:.3g} past its bound"


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_error_within_the_format_bound(fmt, shape):
    torch.manual_seed(0)
    weight = torch.randn(shape) * 0.02
    weight[0, 0] = 0.5  # an outlier: its row / block's scale grows, the others keep theirs
    _within_bound(weight, fmt)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_bf16_weights_and_heavy_tails(fmt):
    torch.manual_seed(1)
    weight = (torch.distributions.StudentT(3.0).sample((300, 260)) * 0.01).bfloat16()
    _within_bound(weight, fmt)


def test_the_bounds_are_not_vacuous():
    """The error stays far below the weights: relative Frobenius error under 1 % for int8 (a uniform rounding of
    amax/127 on Gaussian rows gives ~0.8 %), under 5 % for fp8 (3 mantissa bits)."""
    torch.manual_seed(2)
    weight = torch.randn(576, 1536) * 0.02
    for fmt, most in (("int8", 0.01), ("fp8", 0.05)):
        q, scale = quantize(weight, fmt)
        relative = ((dequantize(q, scale) - weight).norm() / weight.norm()).item()
        assert 0 < relative < most, (fmt, relative)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_zero_rows_and_blocks_stay_exact(fmt):
    weight = torch.randn(256, 300) * 0.02
    weight[5] = 0
    weight[128:256, 128:256] = 0  # a whole fp8 block
    q, scale = quantize(weight, fmt)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    restored = dequantize(q, scale)
    assert torch.equal(restored[5], torch.zeros(300))
    assert torch.equal(restored[128:256, 128:256], torch.zeros(128, 128))


def test_formats_shapes_and_names():
    weight = torch.randn(300, 200)
    q, scale = quantize(weight, "int8")
    assert (q.dtype, q.shape, scale.dtype, scale.shape) == (torch.int8, weight.shape, torch.float32, (300,))
    assert q.abs().max().item() == 127
    q, scale_inv = quantize(weight, "fp8")
    assert (q.dtype, scale_inv.shape) == (torch.float8_e4m3fn, (math.ceil(300 / FP8_BLOCK), math.ceil(200 / FP8_BLOCK)))
    assert q.float().abs().max().item() == 448  # each block's amax maps to e4m3's largest
    assert scale_name("model.layers.0.self_attn.q_proj.weight", "fp8") == "model.layers.0.self_attn.q_proj.weight_scale_inv"
    assert quantized_weight_bytes((300, 200), "int8") == 300 * 200 + 4 * 300
    assert quantized_weight_bytes((300, 200), "fp8") == 300 * 200 + 4 * 3 * 2


def test_which_tensors_are_quantized():
    matrix, vector = torch.zeros(4, 4), torch.zeros(4)
    quantized = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight",
                 "model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
                 "model.layers.2.block_sparse_moe.experts.3.w1.weight", "model.layers.0.mlp.experts.7.up_proj.weight",
                 "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.mlp.shared_expert.gate_proj.weight"]
    kept = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight",
            "model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight"]
    assert all(is_quantized_linear(name, matrix) for name in quantized)
    assert not any(is_quantized_linear(name, matrix) for name in kept)
    assert not is_quantized_linear("model.layers.0.self_attn.q_proj.bias", vector)


def test_stream_rewrite_keeps_order_and_puts_scales_after_their_weight():
    stream = [("model.embed_tokens.weight", torch.randn(10, 8)),
              ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8)),
              ("model.layers.0.input_layernorm.weight", torch.randn(8))]
    out = list(quantized_stream(stream, "int8", torch.bfloat16))
    assert [name for name, _ in out] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                         "model.layers.0.self_attn.q_proj.weight_scale",
                                         "model.layers.0.input_layernorm.weight"]
    assert [t.dtype for _, t in out] == [torch.bfloat16, torch.int8, torch.float32, torch.bfloat16]
    plain = list(quantized_stream(stream, "none"))
    assert [t for _, t in plain] == [t for _, t in stream]
