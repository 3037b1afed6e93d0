"""torchrun worker for tests/test_distill_teacher_layout.py: the student's groups at (TP, PP), the teacher at its own
(TEACHER_TP, TEACHER_PP) in `LayoutGroups`; saved by rank 0 for the test to compare with a teacher at the student's
layout:

- `own_*`: the teacher's scores of a fixed batch at its own layout, from its megatron_legacy conversion there;
- `same_*`: the same teacher's scores at the student's layout (its conversion there), built and run after the
  first, so with the student's groups put back;
- `student_log_probs`, `student_topk_log_probs`: the student's log-probs of the responses and of the own-layout
  teacher's top-k, at the student's layout (the inputs of reverse_kl's advantage and of gkd's divergence);
- `layout_inside`, `layout_after`: (tp, pp, dp) as `current_layout` reads it within the teacher's groups and after.

`teacher_layout_worker TEACHER_CKPTS STUDENT_CKPT OUT_FILE TP PP TEACHER_TP TEACHER_PP`: TEACHER_CKPTS a folder of
conversions named tp{T}_pp{P}; STUDENT_CKPT a torch_dist conversion of the student.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from verl_mega.parallel.process_exit import exit_process

from tests.workers.roles_worker import fixed_batch
from tests.workers.teacher_worker import TOP_K


def student_results(ckpt: str, batch: dict, topk_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The student's log-probs of the responses and of `topk_ids` [B, R, k], at the running layout."""
    from verl_mega.roles.actor import load_gpt_model, response_logprobs
    from verl_mega.roles.logprobs import vocab_parallel_gather_logprobs
    from verl_mega.roles.megatron_step import compute_per_token

    model, vocab_size = load_gpt_model(ckpt)
    model.eval()
    rows, response_length = batch["responses"].shape
    batch = {**batch, "topk_ids": topk_ids.cpu().long()}

    def per_token(logits, micro_batch):
        ids = micro_batch["topk_ids"].to(logits.device)  # trimmed with the responses
        return {"log_probs": response_logprobs(logits, micro_batch, vocab_size, False),
                "topk_log_probs": vocab_parallel_gather_logprobs(logits, ids, vocab_size).flatten(1)}

    with torch.no_grad():
        outputs = compute_per_token(model, batch, 2, ("log_probs", "topk_log_probs"), per_token,
                                    values_per_token={"topk_log_probs": TOP_K})
    return {"student_log_probs": outputs["log_probs"].cpu(),
            "student_topk_log_probs": outputs["topk_log_probs"].view(rows, response_length, TOP_K).cpu()}


def main(teacher_ckpts: str, student_ckpt: str, out_file: str, tp: int, pp: int, teacher_tp: int,
         teacher_pp: int) -> None:
    from verl_mega.parallel.layout_groups import LayoutGroups
    from verl_mega.parallel.state import current_layout, destroy_parallel, init_parallel
    from verl_mega.roles.teacher import Teacher

    init_parallel(tp, pp)
    groups = LayoutGroups(teacher_tp, teacher_pp)
    with groups.active() as inside:
        layout_inside = (current_layout().tp, current_layout().pp, current_layout().dp)
    assert (inside.tp, inside.pp) == (teacher_tp, teacher_pp)
    own = Teacher(Path(teacher_ckpts, f"tp{teacher_tp}_pp{teacher_pp}"), top_k=TOP_K, groups=groups)
    batch = fixed_batch(own.vocab_size, pad_id=0)
    own_scores = own.score(batch, micro_batch_size=2)
    layout_after = (current_layout().tp, current_layout().pp, current_layout().dp)
    same = Teacher(Path(teacher_ckpts, f"tp{tp}_pp{pp}"), top_k=TOP_K)
    same_scores = same.score(batch, micro_batch_size=2)
    results = {**{f"own_{name}": value.cpu() for name, value in own_scores.items()},
               **{f"same_{name}": value.cpu() for name, value in same_scores.items()},
               **student_results(student_ckpt, batch, own_scores["topk_ids"]),
               "layout_inside": torch.tensor(layout_inside), "layout_after": torch.tensor(layout_after)}
    if dist.get_rank() == 0:
        torch.save(results, Path(out_file))
    destroy_parallel()


if __name__ == "__main__":
    main(*sys.argv[1:4], *map(int, sys.argv[4:8]))
    exit_process(0)
