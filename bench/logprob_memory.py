"""Peak live bytes of the actor's log-prob path, forward and backward, at Qwen's vocabulary (V = 152,064):
the output layer's bf16 logits -> `vocab_parallel_logprobs` (log-probs and entropy) -> a loss -> backward,
measured with `rollout.live_bytes.LiveBytes` on one CPU rank.

    python bench/logprob_memory.py [--tokens 1024] [--hidden 64]

Prints the peak against the size of one bf16 copy of the logits: the logits and their bf16 gradient are
2.0x; an fp32 copy kept for backward and its fp32 gradient made it 5.0x.
"""
from __future__ import annotations

import argparse

import torch

from verl_mega.parallel.state import destroy_parallel, init_parallel
from verl_mega.roles.logprobs import vocab_parallel_logprobs
from verl_mega.rollout.live_bytes import LiveBytes

VOCAB = 152_064


def logprob_pass(tokens: int, hidden: int, vocab: int = VOCAB) -> dict:
    """One forward+backward of the log-prob path from random bf16 hidden states through an LM head of `vocab`
    rows: the peak live bytes of it (`peak`), and the logits, labels, log-probs and entropy it computed."""
    generator = torch.Generator().manual_seed(0)
    hidden_states = torch.randn(1, tokens, hidden, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=generator) * 0.05).bfloat16()
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)
    tracker = LiveBytes()
    with tracker:
        logits = hidden_states @ weight.t()
        logprob, entropy = vocab_parallel_logprobs(logits, labels, vocab_size=vocab, return_entropy=True)
        (logprob.sum() + entropy.sum()).backward()
    return {"peak": tracker.peak, "logits": logits.detach(), "labels": labels, "logprob": logprob.detach(),
            "entropy": entropy.detach()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    init_parallel(1, 1)
    peak = logprob_pass(args.tokens, args.hidden)["peak"]
    destroy_parallel()
    logit_bytes = args.tokens * VOCAB * torch.bfloat16.itemsize
    print(f"{args.tokens} tokens x V={VOCAB}: bf16 logits {logit_bytes / 2**20:.1f} MiB, peak live bytes of the "
          f"log-prob forward+backward {peak / 2**20:.1f} MiB = {peak / logit_bytes:.2f}x the bf16 logits")


if __name__ == "__main__":
    main()
