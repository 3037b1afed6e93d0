"""token_logprobs with the vocabulary split over a gloo group equals the single-process full-vocabulary result,
values and gradients, with the compiled kernels and with the PyTorch fallback."""
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_mega.ops import _backend, token_logprobs

TOKENS = (3, 5)
TIMEOUT_S = 120


def vocabulary_splits(world_size):
    even = [8] * world_size
    uneven = [13, 7, 9, 1][:world_size]  # Megatron splits evenly, but nothing here requires it
    return even, uneven


def full_problem(vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*TOKENS, vocab, generator=generator, dtype=torch.float64) * 3
    labels = torch.randint(0, vocab, TOKENS, generator=generator)
    grad_logprob = torch.randn(*TOKENS, generator=generator, dtype=torch.float64)
    grad_entropy = torch.randn(*TOKENS, generator=generator, dtype=torch.float64)
    return logits, labels, grad_logprob, grad_entropy


def logprobs_and_grad(logits, labels, grad_logprob, grad_entropy, tp_group=None):
    logits = logits.detach().requires_grad_()
    logprob, entropy = token_logprobs(logits, labels, tp_group=tp_group, return_entropy=True)
    torch.autograd.backward([logprob, entropy], [grad_logprob.to(logprob.dtype), grad_entropy.to(entropy.dtype)])
    return logprob, entropy, logits.grad


def check_rank(rank, world_size, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        group = dist.new_group(list(range(world_size)))
        for backend_disabled in ("0", "1"):
            os.environ[_backend.DISABLE_ENV_VAR] = backend_disabled
            for split in vocabulary_splits(world_size):
                for dtype, tolerance in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
                    full_logits, labels, grad_logprob, grad_entropy = full_problem(sum(split), seed=sum(split))
                    full_logits = full_logits.to(dtype)
                    want_logprob, want_entropy, want_grad = logprobs_and_grad(
                        full_logits, labels, grad_logprob, grad_entropy
                    )
                    start = sum(split[:rank])
                    local_logits = full_logits[..., start : start + split[rank]]
                    logprob, entropy, grad = logprobs_and_grad(
                        local_logits, labels, grad_logprob, grad_entropy, tp_group=group
                    )
                    where = f"rank {rank}/{world_size}, split {split}, {dtype}, fallback={backend_disabled}"
                    torch.testing.assert_close(logprob, want_logprob, rtol=tolerance, atol=tolerance, msg=where)
                    torch.testing.assert_close(entropy, want_entropy, rtol=tolerance, atol=tolerance, msg=where)
                    torch.testing.assert_close(
                        grad, want_grad[..., start : start + split[rank]], rtol=tolerance, atol=tolerance, msg=where
                    )
        # Labels are global ids: one outside the whole (uneven) vocabulary is refused on every rank.
        local = torch.zeros(2, vocabulary_splits(world_size)[1][rank])
        with pytest.raises(ValueError, match=r"labels must lie in \[0, "):
            token_logprobs(local, torch.tensor([0, sum(vocabulary_splits(world_size)[1])]), tp_group=group)
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_matches_full_vocabulary(world_size):
    context = mp.spawn(check_rank, args=(world_size, free_port()), nprocs=world_size, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"vocab-parallel ranks did not finish within {TIMEOUT_S} s")
