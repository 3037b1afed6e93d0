"""Supervised fine-tuning: the NLL of the assistant's tokens, averaged over every loss token of the global
batch (across data-parallel ranks and micro-batches), through the actor's megatron step."""
from __future__ import annotations

from typing import Iterable

from verl_mega.algorithms import masked_sum_and_count
from verl_mega.data.padding import pad_rows
from verl_mega.data.supervised import LoadedRows, SFTExample, load_sft_examples

from .metrics import StageTimer
from .offline import OfflineJob, limits
from .rollout_batch import build_rollout_batch


def sft_batch(examples: list[SFTExample], pad_token_id: int) -> dict:
    """Prompt left-padded, response right-padded to the longest in the batch; `response_mask` marks the
    assistant's tokens (the loss tokens), not every response token."""
    width = max(len(example.response) for example in examples)
    batch = build_rollout_batch([e.prompt for e in examples], [e.response for e in examples], width, pad_token_id)
    batch["response_mask"], _ = pad_rows([e.loss_mask for e in examples], 0, side="right", width=width)
    return batch


class SFTJob(OfflineJob):
    name = "sft"

    def load_examples(self, paths: list[str]) -> LoadedRows:
        data = self.config.data
        return load_sft_examples(paths, self.tokenizer, limits(self.config), data.prompt_key, data.skip_invalid_rows)

    @staticmethod
    def example_length(example: SFTExample) -> int:
        return len(example.prompt) + len(example.response)

    def make_batch(self, examples: list[SFTExample]) -> dict:
        return sft_batch(examples, self.tokenizer.pad_token_id)

    def update(self, batch: dict, timer: StageTimer) -> dict[str, float]:
        actor = self.config.actor
        with timer("update_actor"):
            metrics = self.actor.update_sft(batch, actor.mini_batch_size, actor.micro_batch_size)
        return {**{f"sft/{name}": value for name, value in metrics.items()},
                "sft/loss_tokens": batch["response_mask"].sum().item()}

    def validation_metrics(self, chunks: Iterable[tuple[dict, int]]) -> dict[str, float]:
        total = count = 0.0
        for batch, rows in chunks:
            log_probs = self.actor.compute_log_prob(batch, self.micro_rows)["log_probs"]
            chunk_total, chunk_count = masked_sum_and_count(-log_probs[:rows].cpu(), batch["response_mask"][:rows])
            total, count = total + chunk_total.item(), count + chunk_count.item()
        return {"loss": total / max(count, 1.0)}
