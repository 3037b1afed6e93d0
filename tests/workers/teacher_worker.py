"""torchrun worker for tests/test_distill_layouts.py: at one TP size, the teacher's scores of a fixed batch, and
the vocabulary-parallel top-k and gathered log-probs (with their gradient) of random logits split over the TP ranks,
saved by rank 0 for the test to compare across layouts and with the full-vocabulary results.

`teacher_worker CKPT OUT_FILE TP`: CKPT a torch_dist conversion (it loads at any layout).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from verl_mega.parallel.process_exit import exit_process

from tests.workers.roles_worker import fixed_batch

TOP_K = 5
VOCAB = 50  # the random logits' vocabulary: 25 per rank at TP 2


def split_logits_results(tp: int) -> dict[str, torch.Tensor]:
    """Top-k and gathered log-probs of random logits, this rank holding its slice of the vocabulary; the
    gradient of a random projection of the gathered ones, as this rank's slice of the full gradient."""
    from megatron.core import parallel_state as ps

    from verl_mega.roles.logprobs import vocab_parallel_gather_logprobs, vocab_parallel_topk

    generator = torch.Generator().manual_seed(3)
    full = torch.randn(2, 3, VOCAB, generator=generator) * 3
    ids = torch.randint(0, VOCAB, (2, 3, 4), generator=generator)
    weights = torch.randn(2, 3, 4, generator=generator)
    rank, width = ps.get_tensor_model_parallel_rank(), VOCAB // tp
    local = full[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    top_log_probs, top_ids = vocab_parallel_topk(local, TOP_K, VOCAB)
    gathered = vocab_parallel_gather_logprobs(local, ids, VOCAB)
    (gathered * weights).sum().backward()
    grads = [torch.empty_like(local.grad) for _ in range(tp)]
    dist.all_gather(grads, local.grad, group=ps.get_tensor_model_parallel_group())
    return {"random_top_log_probs": top_log_probs, "random_top_ids": top_ids, "random_gathered": gathered.detach(),
            "random_grad": torch.cat(grads, dim=-1)}


def main(ckpt: str, out_file: str, tp: int) -> None:
    from verl_mega.parallel.state import destroy_parallel, init_parallel
    from verl_mega.roles.teacher import Teacher

    init_parallel(tp)
    teacher = Teacher(ckpt, top_k=TOP_K)
    scores = teacher.score(fixed_batch(teacher.vocab_size, pad_id=0), micro_batch_size=2)
    results = {**{f"teacher_{name}": value.cpu() for name, value in scores.items()}, **split_logits_results(tp)}
    if dist.get_rank() == 0:
        torch.save(results, Path(out_file))
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    exit_process(0)
