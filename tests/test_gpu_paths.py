"""Seams of the GPU training paths that run on one CPU rank: the log-prob path's memory at a real vocabulary
and the attention inputs of the transformer-engine layers."""
import pytest
import torch

from verl_mega.parallel.state import destroy_parallel, init_parallel
from verl_mega.roles.logprobs import vocab_parallel_logprobs
from verl_mega.rollout.live_bytes import LiveBytes

QWEN_VOCAB = 152_064


@pytest.fixture(scope="module")
def one_rank():
    init_parallel(1, 1)
    yield
    destroy_parallel()


def test_bf16_logprobs_keep_no_fp32_copy_of_the_logits(one_rank):
    """Forward and backward from bf16 logits at Qwen's vocabulary hold the logits and their gradient, both
    bf16 (4 bytes per logit): an fp32 copy kept for backward, or an fp32 gradient, would need at least 8."""
    tokens, hidden = 16, 32
    generator = torch.Generator().manual_seed(0)
    hidden_states = torch.randn(1, tokens, hidden, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(QWEN_VOCAB, hidden, generator=generator) * 0.05).bfloat16()
    labels = torch.randint(0, QWEN_VOCAB, (1, tokens), generator=generator)
    tracker = LiveBytes()
    with tracker:
        logits = hidden_states @ weight.t()
        logprob, entropy = vocab_parallel_logprobs(logits, labels, vocab_size=QWEN_VOCAB, return_entropy=True)
        (logprob.sum() + entropy.sum()).backward()
    logit_bytes = tokens * QWEN_VOCAB * torch.bfloat16.itemsize
    assert tracker.peak <= 2 * logit_bytes + 2**16, (tracker.peak, logit_bytes)

    reference = torch.log_softmax(logits.detach().double(), -1)
    want = reference.gather(-1, labels[..., None])[..., 0]
    want_entropy = -(reference.exp() * reference).sum(-1)
    assert logprob.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logprob.double(), want, rtol=0, atol=1e-4)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vocabulary_padding_is_masked_in_the_model_dtype(one_rank, dtype):
    """Padded vocabulary rows take no probability, also in fp16, where -1e30 does not exist."""
    vocab, padded = 100, 128
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, padded, generator=generator).to(dtype)
    labels = torch.randint(0, vocab, (3,), generator=generator)
    logprob = vocab_parallel_logprobs(logits, labels, vocab_size=vocab, return_entropy=False)
    want = torch.log_softmax(logits[:, :vocab].double(), -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(logprob.double(), want, rtol=0, atol=1e-5)
