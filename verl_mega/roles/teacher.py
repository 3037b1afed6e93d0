"""The teacher of on-policy distillation: a frozen model, loaded from its own converted checkpoint (not the
actor's), that scores every token the student sampled. Like the reference it runs forward-only, with no DDP and
no optimizer; unlike it, it is separate weights whatever the student trains (LoRA adapters or all of them).

For each response token it gives its log-prob under the teacher, the teacher's entropy there and whether the
sampled token is the teacher's most likely one; with `top_k`, the teacher's k most likely tokens there and their
log-probs (GKD's divergence is taken over them).

At its own layout (teacher.tp / teacher.pp other than the student's) it is built and scores within its
`LayoutGroups`: the batch is the whole step's on every rank, as for every role, so the teacher's data-parallel ranks
take their slices of it and every rank gets the whole result back, whichever layout scored it."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from verl_mega.parallel.layout_groups import LayoutGroups

from .actor import load_gpt_model, response_logprobs
from .batching import Batch
from .logprobs import vocab_parallel_topk
from .megatron_step import compute_per_token, resolve_sequence_packing


class Teacher:
    def __init__(self, ckpt_dir: str | Path, top_k: int = 0, packed_sequences: str = "auto",
                 temperature: float = 1.0, groups: LayoutGroups | None = None, **config_overrides):
        """`top_k`: 0, or the teacher's most likely tokens to return at each position. `temperature`: the
        log-probs' (the student's sampling temperature, so both distributions compared are at it).
        `packed_sequences`: the actor's setting (the batches are the actor's). `groups`: the teacher's own layout
        (default: the running one, the student's)."""
        self.groups = groups
        with self._layout():
            self.model, self.vocab_size = load_gpt_model(ckpt_dir, **config_overrides)
            self.packed = resolve_sequence_packing(packed_sequences, self.model, "actor.use_packed_sequences")
        self.top_k, self.temperature = top_k, temperature
        self.model.requires_grad_(False)
        self.model.eval()

    def score(self, batch: Batch, micro_batch_size: int, max_tokens: int = 0) -> dict[str, torch.Tensor]:
        """On every rank, float32 on the device: 'log_probs', 'entropy' and 'top1_match' (1 where the sampled
        token is the teacher's most likely) [B, R]; with top_k, 'topk_ids' (exact in float32: ids < 2^24) and
        'topk_log_probs' [B, R, k]."""
        k = max(self.top_k, 1)

        def per_token(logits: torch.Tensor, micro_batch: Batch) -> dict[str, torch.Tensor]:
            log_probs, entropy = response_logprobs(logits, micro_batch, self.vocab_size, True, self.temperature)
            scaled = logits / self.temperature if self.temperature != 1 else logits
            top_log_probs, top_ids = vocab_parallel_topk(scaled, k, self.vocab_size)
            responses = micro_batch["responses"].to(top_ids.device)
            outputs = {"log_probs": log_probs, "entropy": entropy,
                       "top1_match": (top_ids[..., 0] == responses).float()}
            if self.top_k:
                outputs["topk_ids"] = top_ids.float().flatten(1)
                outputs["topk_log_probs"] = top_log_probs.flatten(1)
            return outputs

        names = ("log_probs", "entropy", "top1_match") + (("topk_ids", "topk_log_probs") if self.top_k else ())
        with self._layout():
            outputs = compute_per_token(self.model, batch, micro_batch_size, names, per_token, max_tokens,
                                        self.packed, values_per_token={"topk_ids": k, "topk_log_probs": k})
        rows, response_length = batch["responses"].shape
        for name in ("topk_ids", "topk_log_probs"):
            if name in outputs:
                outputs[name] = outputs[name].view(rows, response_length, k)
        return outputs

    def _layout(self):
        """The teacher's process groups in place for a block (nothing to change at the student's layout)."""
        return self.groups.active() if self.groups is not None else contextlib.nullcontext()
