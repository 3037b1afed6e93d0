"""verl_mega.ops: compiled kernels against the PyTorch reference, gradients, the fallback, bad input.

Kernel tests run on the CPU and, where a GPU is present (bench/gpu_check.sh), on CUDA as well.
"""
import importlib
import warnings

import pytest
import torch

from verl_mega.ops import _backend, gae, fallback, token_logprobs

FP32_RTOL = 1e-6
# Rows shaped to hit the vector body only, the scalar tail only, both, and a single column.
PARTIAL_SHAPES = [(1, 1), (1, 7), (5, 8), (5, 33), (17, 1000), (3, 4099)]


@pytest.fixture(
    params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
)
def device(request):
    return torch.device(request.param)


def compiled_for(device):
    """The compiled module under test; a missing one fails the test rather than testing the fallback twice."""
    return importlib.import_module(_backend.COMPILED_MODULES[device.type])


@pytest.fixture(params=["compiled", "fallback"])
def backend(request, monkeypatch):
    """Runs a test through the compiled kernels and again through the forced PyTorch fallback."""
    if request.param == "fallback":
        monkeypatch.setenv(_backend.DISABLE_ENV_VAR, "1")
    else:
        monkeypatch.delenv(_backend.DISABLE_ENV_VAR, raising=False)
    return request.param


def assert_relative_close(got, want, rtol=FP32_RTOL):
    """Error relative to the tensor's magnitude (max norm): element-wise relative error is meaningless where a
    value cancels to near 0, e.g. a GAE advantage or the log-prob of a near-certain token."""
    assert got.shape == want.shape
    scale = want.abs().max().item() if want.numel() else 0.0
    error = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    assert error <= rtol * max(scale, 1e-30), f"max error {error:.3g} > {rtol:g} x max magnitude {scale:.3g}"


def random_logits(*shape, dtype=torch.float32, scale=3.0, seed=0, device="cpu", misaligned=False):
    """Random logits; `misaligned` places them one element into their buffer, which rules out vector loads."""
    generator = torch.Generator().manual_seed(seed)
    values = (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)
    if misaligned:
        buffer = torch.empty(values.numel() + 1, dtype=dtype)
        buffer[1:] = values.flatten()
        values = buffer[1:].view(shape)
    return values.to(device)


def random_labels(*shape, vocab, seed=1, device="cpu"):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def full_softmax_oracle(logits, labels):
    """The textbook computation in float64, materialising everything."""
    log_p = torch.log_softmax(logits.double(), dim=-1)
    entropy = -(log_p.exp() * torch.where(log_p.isfinite(), log_p, 0.0)).sum(-1)
    return log_p.gather(-1, labels[..., None])[..., 0], entropy


# --- token log-probs: kernel partials against the reference ---------------------------------------------


@pytest.mark.parametrize("rows,vocab", PARTIAL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("vocab_start", [0, 3])
@pytest.mark.parametrize("misaligned", [False, True])
def test_partials_match_reference(device, rows, vocab, dtype, vocab_start, misaligned):
    logits = random_logits(rows, vocab, dtype=dtype, device=device, misaligned=misaligned)
    # Some labels fall before or after this slice, as on the other ranks of a tensor-parallel group.
    labels = random_labels(rows, vocab=vocab + 6, device=device)
    for with_entropy in (False, True):
        got = compiled_for(device).logprob_partials(logits, labels, vocab_start, with_entropy)
        want = fallback.logprob_partials(logits, labels, vocab_start, with_entropy)
        for name, g, w in zip(["row_max", "sum_exp", "label_logit", "shifted_sum"], got, want):
            if w is None:
                assert g is None
                continue
            assert g.dtype == w.dtype == fallback.accumulation_dtype(dtype), name
            assert_relative_close(g, w)


@pytest.mark.parametrize("rows,vocab", PARTIAL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("gradients", [("logprob",), ("entropy",), ("logprob", "entropy")])
def test_backward_matches_reference(device, rows, vocab, dtype, gradients):
    logits = random_logits(rows, vocab, dtype=dtype, device=device, misaligned=vocab % 2 == 1)
    labels = random_labels(rows, vocab=vocab + 6, device=device)
    acc = fallback.accumulation_dtype(dtype)
    row_max, sum_exp, _, shifted_sum = fallback.logprob_partials(logits, labels, 3, True)
    per_row = torch.Generator().manual_seed(4)
    inputs = dict(
        log_normalizer=row_max + sum_exp.log(),
        grad_logprob=torch.randn(rows, generator=per_row).to(device, acc) if "logprob" in gradients else None,
        mean_logit=row_max + shifted_sum / sum_exp if "entropy" in gradients else None,
        grad_entropy=torch.randn(rows, generator=per_row).to(device, acc) if "entropy" in gradients else None,
    )
    got = compiled_for(device).logprob_backward(logits, labels, 3, **inputs)
    want = fallback.logprob_backward(logits, labels, 3, **inputs)
    assert got.dtype == want.dtype == dtype
    if dtype in (torch.bfloat16, torch.float16):  # one rounding of each gradient to 16 bits
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-5)
    else:
        assert_relative_close(got, want)


@pytest.mark.parametrize("leading", [(), (1,), (4, 1), (2, 3, 5)])
@pytest.mark.parametrize("vocab", [1, 9, 300])
def test_logprobs_and_entropy_match_oracle(backend, device, leading, vocab):
    logits = random_logits(*leading, vocab, device=device)
    labels = random_labels(*leading, vocab=vocab, device=device)
    logprob, entropy = token_logprobs(logits, labels, return_entropy=True)
    want_logprob, want_entropy = full_softmax_oracle(logits, labels)
    assert logprob.shape == entropy.shape == labels.shape and logprob.dtype == torch.float32
    assert_relative_close(logprob, want_logprob)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(token_logprobs(logits, labels), logprob, rtol=0, atol=0)


def test_strided_inputs(backend):
    """Non-contiguous logits and labels (e.g. slices of a padded batch) are accepted."""
    logits = random_logits(4, 10, 33).transpose(0, 1)
    labels = random_labels(10, 8, vocab=33)[:, ::2]
    assert not logits.is_contiguous() and not labels.is_contiguous()
    assert_relative_close(token_logprobs(logits, labels), full_softmax_oracle(logits, labels)[0])
    rewards, values = random_logits(6, 9).t(), random_logits(6, 9, seed=3).t()
    mask = random_mask(6, 9, "multi_turn").t()
    advantages, _ = gae(rewards, values, mask, 0.9, 0.8)
    assert_relative_close(advantages, fallback.gae(rewards, values, mask, 0.9, 0.8)[0])


def test_kernel_equals_fallback_fp32(monkeypatch):
    logits, labels = random_logits(64, 5000), random_labels(64, vocab=5000)
    got = token_logprobs(logits, labels, return_entropy=True)
    monkeypatch.setenv(_backend.DISABLE_ENV_VAR, "1")
    want = token_logprobs(logits, labels, return_entropy=True)
    for g, w in zip(got, want):
        assert_relative_close(g, w)


def test_bfloat16_within_bfloat16_tolerance(backend):
    logits32 = random_logits(6, 7, 301)
    labels = random_labels(6, 7, vocab=301)
    logits = logits32.bfloat16().requires_grad_()
    logprob, entropy = token_logprobs(logits, labels, return_entropy=True)
    assert logprob.dtype == torch.float32
    want_logprob, want_entropy = full_softmax_oracle(logits32, labels)
    # Rounding logits of magnitude ~10 to bfloat16 moves them by up to 0.03.
    torch.testing.assert_close(logprob.double(), want_logprob, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=2e-2, atol=5e-2)
    (logprob.sum() + entropy.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16

    reference_logits = logits32.bfloat16().double().requires_grad_()
    want_lp, want_ent = full_softmax_oracle(reference_logits, labels)
    (want_lp.sum() + want_ent.sum()).backward()
    torch.testing.assert_close(logits.grad.double(), reference_logits.grad, rtol=1e-2, atol=1e-2)


def test_masked_vocabulary_entries(backend):
    """-inf logits (a masked or padded vocabulary) give finite results and ~0, not NaN, gradients."""
    logits = random_logits(4, 50)
    logits[:, 40:] = float("-inf")
    logits[0, :20] = float("-inf")
    logits.requires_grad_()
    labels = torch.tensor([25, 3, 39, 0])
    logprob, entropy = token_logprobs(logits, labels, return_entropy=True)
    want_logprob, want_entropy = full_softmax_oracle(logits.detach(), labels)
    assert_relative_close(logprob, want_logprob)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=1e-5, atol=1e-5)
    (logprob.sum() + entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    # The kernels floor exponents at -87: what a masked entry receives is below 1e-35, not exactly 0.
    assert logits.grad[:, 40:].abs().max() < 1e-35


# --- token log-probs: gradients ----------------------------------------------------------------------------


@pytest.mark.parametrize("return_entropy", [False, True])
def test_gradcheck_float64(backend, device, return_entropy):
    logits = random_logits(3, 4, 11, dtype=torch.float64, scale=1.0, device=device).requires_grad_()
    labels = random_labels(3, 4, vocab=11, device=device)
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, labels, return_entropy=return_entropy), (logits,), eps=1e-6, atol=1e-6
    )


def test_gradcheck_entropy_only(backend):
    logits = random_logits(5, 13, dtype=torch.float64, scale=1.0).requires_grad_()
    labels = random_labels(5, vocab=13)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, labels, return_entropy=True)[1], (logits,))


@pytest.mark.parametrize("return_entropy", [False, True])
def test_fp32_gradient_matches_autograd_of_log_softmax(backend, return_entropy):
    logits = random_logits(2, 9, 777).requires_grad_()
    labels = random_labels(2, 9, vocab=777)
    upstream = torch.randn(2, 9, generator=torch.Generator().manual_seed(5))
    outputs = token_logprobs(logits, labels, return_entropy=return_entropy)
    outputs = outputs if return_entropy else (outputs,)
    sum(upstream * out for out in outputs).sum().backward()

    reference_logits = logits.detach().double().requires_grad_()
    want = full_softmax_oracle(reference_logits, labels)[: len(outputs)]
    sum(upstream.double() * out for out in want).sum().backward()
    torch.testing.assert_close(logits.grad.double(), reference_logits.grad, rtol=1e-5, atol=1e-6)


# --- GAE -----------------------------------------------------------------------------------------------------


def random_mask(batch, steps, kind, seed=2):
    generator = torch.Generator().manual_seed(seed)
    if kind == "full":
        return torch.ones(batch, steps, dtype=torch.bool)
    if kind == "none":
        return torch.zeros(batch, steps, dtype=torch.bool)
    if kind == "ragged":  # right padding after each response
        lengths = torch.randint(0, steps + 1, (batch, 1), generator=generator)
        return torch.arange(steps) < lengths
    return torch.rand(batch, steps, generator=generator) < 0.6  # "multi_turn": holes of tool output


GAE_SHAPES = [(1, 1), (1, 9), (3, 1), (7, 33), (64, 257)]
MASK_KINDS = ["full", "none", "ragged", "multi_turn"]


@pytest.mark.parametrize("batch,steps", GAE_SHAPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gae_kernel_matches_reference(device, batch, steps, kind, dtype):
    rewards = random_logits(batch, steps, dtype=dtype, scale=1.0, device=device)
    values = random_logits(batch, steps, dtype=dtype, seed=3, device=device)
    mask = random_mask(batch, steps, kind).to(device)
    got = compiled_for(device).gae(rewards, values, mask, 0.99, 0.95)
    want = fallback.gae(rewards, values, mask, 0.99, 0.95)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == fallback.accumulation_dtype(dtype)
        assert_relative_close(g, w)


def inputs_split_into_tasks():
    """Inputs of many 2^16-element blocks of rows (the size the CPU kernels once split over threads)."""
    logits, labels = random_logits(600, 1000), random_labels(600, vocab=1000)  # 10 tasks of 65 rows
    shape = (1027, 260)  # 5 tasks of 31 SIMD groups; 1027 leaves sequences outside the groups
    rewards, values = random_logits(*shape, scale=1.0), random_logits(*shape, seed=3)
    return logits, labels, rewards, values, random_mask(*shape, "multi_turn")


def kernel_outputs(kernels, threads):
    """Every kernel's outputs on inputs_split_into_tasks(), with torch at `threads` threads."""
    logits, labels, rewards, values, mask = inputs_split_into_tasks()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        partials = kernels.logprob_partials(logits, labels, 0, True)
        log_z = partials[0] + partials[1].log()
        backward = kernels.logprob_backward(logits, labels, 0, log_z, partials[1], partials[0], partials[2])
        return [*partials, backward, *kernels.gae(rewards, values, mask, 0.99, 0.95)]
    finally:
        torch.set_num_threads(threads_before)


def test_cpu_kernels_same_bits_on_any_thread_count():
    """The kernels run on the calling thread whatever torch's thread count (docs/kernels.md); calls at two
    threads, repeated, must match one thread bit for bit."""
    one_thread = kernel_outputs(compiled_for(torch.device("cpu")), 1)
    for got, want in zip(one_thread, kernel_outputs(fallback, 1), strict=True):
        assert_relative_close(got, want)
    for _ in range(5):
        for got, want in zip(kernel_outputs(compiled_for(torch.device("cpu")), 2), one_thread, strict=True):
            assert torch.equal(got, want)


def test_gae_by_hand(backend):
    """Two masked-in tokens around a tool token: the tool token is skipped, not a sequence break."""
    gamma, lam = 0.5, 0.8
    rewards = torch.tensor([[0.0, 5.0, 1.0, 7.0]])
    values = torch.tensor([[2.0, 3.0, 4.0, 9.0]])
    mask = torch.tensor([[1, 0, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    last = 1.0 - 4.0  # t=2: nothing valid follows
    first = (0.0 + gamma * 4.0 - 2.0) + gamma * lam * last  # t=0: the next valid token is t=2
    torch.testing.assert_close(advantages, torch.tensor([[first, 0.0, last, 0.0]]))
    torch.testing.assert_close(returns, advantages + values)


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_gae_skips_masked_tokens(backend, kind):
    """On masked-in tokens, GAE equals GAE over the response with the masked-out tokens cut away."""
    rewards, values = random_logits(6, 40, scale=1.0), random_logits(6, 40, seed=3)
    mask = random_mask(6, 40, kind)
    advantages, returns = gae(rewards, values, mask.int(), 1.0, 0.9)
    assert (advantages[~mask] == 0).all()
    torch.testing.assert_close(returns, advantages + values)
    for row in range(6):
        kept = mask[row]
        compact = fallback.gae(rewards[row, kept][None], values[row, kept][None], kept[kept][None], 1.0, 0.9)[0]
        assert_relative_close(advantages[row, kept], compact[0])


# --- fallback ---------------------------------------------------------------------------------------------------


def test_env_var_forces_reference(monkeypatch):
    assert _backend.kernels_for(torch.device("cpu")) is compiled_for(torch.device("cpu"))
    monkeypatch.setenv(_backend.DISABLE_ENV_VAR, "1")
    assert _backend.kernels_for(torch.device("cpu")) is fallback


def test_missing_extension_warns_once(monkeypatch):
    monkeypatch.setitem(_backend.COMPILED_MODULES, "cpu", "verl_mega._no_such_kernels")
    _backend._import_compiled.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                token_logprobs(random_logits(2, 5), random_labels(2, vocab=5))
                gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 1.0, 1.0)
        assert len([w for w in caught if "verl_mega._no_such_kernels" in str(w.message)]) == 1
        assert _backend.kernels_for(torch.device("cpu")) is fallback
    finally:
        _backend._import_compiled.cache_clear()


# --- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logits,labels,error,match",
    [
        (torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), ValueError, "logits must be shaped"),
        (torch.zeros(2, 5), torch.tensor([0, 5]), ValueError, r"labels must lie in \[0, 5\)"),
        (torch.zeros(2, 5), torch.tensor([-1, 0]), ValueError, "labels must lie"),
        (torch.zeros(2, 5, dtype=torch.long), torch.tensor([0, 1]), TypeError, "logits must be a floating"),
        (torch.zeros(2, 5), torch.tensor([0.0, 1.0]), TypeError, "labels must be an integer"),
        (torch.zeros(2, 0), torch.zeros(2, dtype=torch.long), ValueError, "empty vocabulary"),
        ([[0.0, 1.0]], torch.tensor([0]), TypeError, "logits must be a torch.Tensor"),
    ],
)
def test_token_logprobs_rejects_bad_input(logits, labels, error, match):
    with pytest.raises(error, match=match):
        token_logprobs(logits, labels)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"values": torch.zeros(2, 4)}, ValueError, "values must have the shape"),
        ({"response_mask": torch.ones(3, 2)}, ValueError, "response_mask must have the shape"),
        ({"token_rewards": torch.zeros(6)}, ValueError, r"token_rewards must be \[batch, time\]"),
        ({"token_rewards": torch.zeros(2, 3, dtype=torch.long)}, TypeError, "token_rewards must be a floating"),
        ({"gamma": torch.tensor(0.9)}, TypeError, "gamma must be a real number"),
        ({"lam": None}, TypeError, "lam must be a real number"),
    ],
)
def test_gae_rejects_bad_input(kwargs, error, match):
    arguments = dict(token_rewards=torch.zeros(2, 3), values=torch.zeros(2, 3), response_mask=torch.ones(2, 3),
                     gamma=1.0, lam=0.95)
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        gae(**arguments)
