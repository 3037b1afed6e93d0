"""verl_mega.ops.rms_norm: the CPU kernel against the PyTorch reference and against torch's own RMSNorm,
forward and backward, in every dtype; float64 gradcheck; the same bits on any thread count."""
import importlib

import pytest
import torch
import torch.nn.functional as F

from verl_mega.ops import FusedRMSNorm, fallback, rms_norm

from .test_ops import assert_relative_close, backend  # noqa: F401  (backend is a fixture)

# Rows shaped to hit the vector body only, the scalar tail only, both, and a single column.
SHAPES = [(1, 1), (5, 7), (5, 8), (17, 33), (3, 4099)]
# float32 sums of `hidden` terms: ~sqrt(hidden) u relative, u = 6e-8; half types round each output once.
RTOL = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rows_and_weight(rows, hidden, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=generator, dtype=torch.float64) * 3
    weight = torch.randn(hidden, generator=generator, dtype=torch.float64)
    grad = torch.randn(rows, hidden, generator=generator, dtype=torch.float64)
    return x.to(dtype), weight.to(dtype), grad.to(dtype)


@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_kernel_matches_reference(rows, hidden, dtype):
    kernels = importlib.import_module("verl_mega._kernels")
    x, weight, grad = rows_and_weight(rows, hidden, dtype)
    y, rstd = kernels.rms_norm_forward(x, weight, 1e-6)
    want_y, want_rstd = fallback.rms_norm_forward(x, weight, 1e-6)
    assert y.dtype == dtype and rstd.dtype == want_rstd.dtype
    assert_relative_close(rstd, want_rstd, RTOL[torch.float32] if dtype != torch.float64 else RTOL[dtype])
    assert_relative_close(y, want_y, RTOL[dtype])
    grad_x, grad_weight = kernels.rms_norm_backward(grad, x, weight, rstd)
    want_grad_x, want_grad_weight = fallback.rms_norm_backward(grad, x, weight, want_rstd)
    assert grad_x.dtype == dtype and grad_weight.dtype == dtype
    # grad_x is a difference of terms of size |g w| rstd that can cancel to ~0 (always, at hidden = 1): its
    # rounding error is relative to those terms, not to the result.
    terms = (grad.double() * weight.double() * want_rstd.double()[:, None]).abs().max().item()
    assert (grad_x.double() - want_grad_x.double()).abs().max().item() <= RTOL[dtype] * terms
    assert_relative_close(grad_weight, want_grad_weight, RTOL[dtype])


@pytest.mark.parametrize("leading", [(), (4,), (3, 5)])
def test_values_and_gradients_equal_torch_rms_norm(backend, leading):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*leading, 7, 96, generator=generator).requires_grad_()
    weight = torch.randn(96, generator=generator).requires_grad_()
    grad = torch.randn(*leading, 7, 96, generator=generator)
    ours = rms_norm(x, weight, 1e-5)
    theirs = F.rms_norm(x, (96,), weight, 1e-5)
    assert_relative_close(ours, theirs, RTOL[torch.float32])
    for got, want in zip(torch.autograd.grad(ours, (x, weight), grad), torch.autograd.grad(theirs, (x, weight), grad)):
        assert_relative_close(got, want, 2e-5)  # torch's decomposed backward rounds more often than one pass


def test_gradcheck_float64(backend):
    x, weight, _ = rows_and_weight(4, 13, torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x.requires_grad_(), weight.requires_grad_()))


def test_same_bits_on_any_thread_count():
    kernels = importlib.import_module("verl_mega._kernels")
    x, weight, grad = rows_and_weight(4096, 256, torch.float32)  # many tasks, so 2 threads share them
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            y, rstd = kernels.rms_norm_forward(x, weight, 1e-6)
            results.append((y, rstd, *kernels.rms_norm_backward(grad, x, weight, rstd)))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_module_is_torch_rms_norm_with_the_same_state():
    torch_norm = torch.nn.RMSNorm(32, eps=1e-5)
    torch.nn.init.normal_(torch_norm.weight)
    fused = FusedRMSNorm(32, eps=1e-5)
    fused.load_state_dict(torch_norm.state_dict())
    x = torch.randn(3, 32)
    assert isinstance(fused, torch.nn.RMSNorm) and list(fused.state_dict()) == ["weight"]
    assert_relative_close(fused(x), torch_norm(x), RTOL[torch.float32])


def test_kernel_refuses_mismatched_weight():
    kernels = importlib.import_module("verl_mega._kernels")
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm_forward(torch.randn(2, 8), torch.randn(7), 1e-6)
