"""Preference optimisation (`algorithm.loss`: dpo, ipo, kto, simpo, orpo) through the actor's megatron step.

Per batch: the frozen reference scores the completions (not for SimPO / ORPO; with
`algorithm.cache_reference_logprobs` they are scored once for the whole data set and read from the run
folder), KTO's KL baseline is estimated on the batch's prompts paired with other rows' completions, then the
actor takes its steps on the sequence loss. Metrics: loss, rewards of chosen / rejected (desirable / undesirable), margins, accuracy, log-probs.
"""
from __future__ import annotations

from typing import Iterable

import gc
from dataclasses import replace

import torch
import torch.distributed as dist

from verl_mega.algorithms import UNPAIRED_LOSSES, kto_kl_baseline, masked_sum
from verl_mega.data.supervised import LoadedRows, PreferenceExample, load_preference_examples
from verl_mega.models.builder import memory_overrides
from verl_mega.roles.megatron_step import MicroBatchShare
from verl_mega.roles.preference import (
    KTO_METRICS, PAIR_METRICS, kto_sequence_loss, kto_shares, loss_needs_reference, pair_sequence_loss,
)
from verl_mega.roles.reference import AdaptersOffReference, Reference, reference_of
from verl_mega.run.folder import RunFolder

from .metrics import StageTimer, print_note
from .offline import OfflineJob, limits
from .reference_cache import cache_key, read_cache, write_cache
from .rollout_batch import build_rollout_batch


def preference_batch(examples: list[PreferenceExample], pad_token_id: int) -> dict:
    """One row per completion, a pair's chosen and rejected rows next to each other; KTO rows carry
    `desirable` [B]."""
    prompts = [example.prompt for example in examples for _ in example.completions]
    completions = [completion for example in examples for completion in example.completions]
    batch = build_rollout_batch(prompts, completions, max(map(len, completions)), pad_token_id)
    batch["desirable"] = torch.tensor([example.desirable for example in examples for _ in example.completions])
    if all(example.reference_logps is not None for example in examples):
        batch["ref_sequence_log_probs"] = torch.tensor(
            [logp for example in examples for logp in example.reference_logps], dtype=torch.float32)
    return batch


def with_reference_logps(examples: list[PreferenceExample], values: torch.Tensor) -> list[PreferenceExample]:
    """`examples` carrying their rows of `values` (one per completion, in batch-row order)."""
    per_example = values.view(len(examples), -1).tolist() if examples else []
    return [replace(example, reference_logps=tuple(logps)) for example, logps in zip(examples, per_example)]


class PreferenceJob(OfflineJob):
    name = "preference"  # also its metrics' prefix, whichever loss (a KTO run is no DPO run)

    @property
    def unpaired(self) -> bool:
        """KTO: one completion per example, labelled desirable or not, instead of a chosen / rejected pair."""
        return self.config.algorithm.loss in UNPAIRED_LOSSES

    @property
    def rows_per_example(self) -> int:
        return 1 if self.unpaired else 2

    def build(self, actor_ckpt) -> None:
        """The offline job's examples and actor, then the reference (or its cached log-probs) and the loss."""
        super().build(actor_ckpt)
        algorithm = self.config.algorithm
        self.reference = (self.build_reference(actor_ckpt) if loss_needs_reference(algorithm.loss)
                          and not algorithm.cache_reference_logprobs else None)
        self.sequence_loss = kto_sequence_loss(algorithm) if self.unpaired else pair_sequence_loss(algorithm)
        self.metric_names = KTO_METRICS if self.unpaired else PAIR_METRICS
        if algorithm.cache_reference_logprobs:
            self.use_cached_reference_logps()

    def build_reference(self, actor_ckpt) -> Reference | AdaptersOffReference:
        """The frozen reference, in the actor's dtype and sequence layout, as in PPO (with LoRA: the actor's
        model with its adapters off)."""
        return reference_of(self.actor, actor_ckpt, dtype=self.config.model.dtype,
                            packed_sequences=self.config.actor.use_packed_sequences,
                            **memory_overrides(self.config.actor, self.config.parallel))

    def use_cached_reference_logps(self) -> None:
        """Attach the reference's log-probs to every example, read from the run folder's cache or, without a
        valid one, computed once (the reference model is built for that only, then freed) and cached."""
        path = RunFolder(self.run_dir).reference_logprobs
        data = self.config.data
        splits = {"train": self.train_examples, "val": self.val_examples}
        key = cache_key([*data.train_files, *data.val_files], splits, self.actor_ckpt, self.config.model.dtype)
        rows = {split: len(examples) * self.rows_per_example for split, examples in splits.items()}
        values = read_cache(path, key, rows)
        if values is None:
            if path.exists() and self.layout.rank == 0:
                print_note(f"{path} was computed for other data, model or settings: recomputing it",
                           self.config.trainer.log_format)
            self.reference = self.build_reference(self.actor_ckpt)
            values = {split: self.reference_logps_of(examples) for split, examples in splits.items()}
            self.reference = None
            gc.collect()  # its memory back now, not at the next cycle collection (module graphs hold cycles)
            if self.layout.rank == 0:
                write_cache(path, key, values)
            dist.barrier()
        self.train_examples = with_reference_logps(self.train_examples, values["train"])
        self.val_examples = with_reference_logps(self.val_examples, values["val"])

    def reference_logps_of(self, examples: list[PreferenceExample]) -> torch.Tensor:
        """[rows] the reference's summed log-probs of `examples`' completions, scored in `data.batch_size` chunks
        (each rank its data-parallel share)."""
        scored = [self.sequence_logps(self.reference.compute_ref_log_prob, batch)[:rows]
                  for batch, rows in self.chunks(examples)]
        return torch.cat(scored) if scored else torch.zeros(0)

    def load_examples(self, paths: list[str]) -> LoadedRows:
        data = self.config.data
        return load_preference_examples(paths, self.tokenizer, limits(self.config), unpaired=self.unpaired,
                                        prompt_key=data.prompt_key, skip_invalid=data.skip_invalid_rows)

    @staticmethod
    def example_length(example: PreferenceExample) -> int:
        return len(example.prompt) + max(map(len, example.completions))

    def make_batch(self, examples: list[PreferenceExample]) -> dict:
        return preference_batch(examples, self.tokenizer.pad_token_id)

    def prepare(self, batch: dict, timer: StageTimer) -> None:
        """Add what the loss reads besides the policy's log-probs: reference log-probs, KTO's baseline and
        per-kind shares (all over the global batch)."""
        if self.reference is not None and "ref_sequence_log_probs" not in batch:
            with timer("ref_log_prob"):
                batch["ref_sequence_log_probs"] = self.sequence_logps(self.reference.compute_ref_log_prob, batch)
        if self.unpaired:
            with timer("kl_baseline"):
                batch["kl_baseline"] = self.kl_baseline(batch).expand(len(batch["desirable"])).contiguous()
            batch["desirable_share"], batch["undesirable_share"] = kto_shares(batch["desirable"])

    def sequence_logps(self, score, batch: dict) -> torch.Tensor:
        """[B] summed response log-probs under `score(batch, micro_batch_size)` (a forward-only role call)."""
        return masked_sum(score(batch, self.micro_rows).cpu(), batch["response_mask"], dim=-1)

    def policy_logps(self, batch: dict) -> torch.Tensor:
        return self.sequence_logps(lambda rows, micro: self.actor.compute_log_prob(rows, micro)["log_probs"], batch)

    def kl_baseline(self, batch: dict) -> torch.Tensor:
        """z₀ from each prompt with the next row's completion (Ethayarajh et al.: mismatched pairs)."""
        rows = len(batch["desirable"])
        prompt_width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        shifted = torch.roll(torch.arange(rows), -1)
        prompts = [ids[mask.bool()].tolist() for ids, mask in
                   zip(batch["input_ids"][:, :prompt_width], batch["attention_mask"][:, :prompt_width])]
        completions = [ids[mask.bool()].tolist() for ids, mask in
                       zip(batch["responses"][shifted], batch["response_mask"][shifted])]
        mismatched = build_rollout_batch(prompts, completions, batch["responses"].shape[1],
                                          self.tokenizer.pad_token_id)
        return kto_kl_baseline(self.policy_logps(mismatched),
                               self.sequence_logps(self.reference.compute_ref_log_prob, mismatched))

    def update(self, batch: dict, timer: StageTimer) -> dict[str, float]:
        actor = self.config.actor
        self.prepare(batch, timer)
        with timer("update_actor"):
            metrics = self.actor.update_on_sequences(batch, actor.mini_batch_size * self.rows_per_example,
                                                     self.micro_rows, self.metric_names, self.sequence_loss)
        return {f"{self.name}/{name}": value for name, value in self._with_margins(metrics).items()}

    def _with_margins(self, metrics: dict) -> dict:
        if self.unpaired:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return metrics

    def validation_metrics(self, chunks: Iterable[tuple[dict, int]]) -> dict[str, float]:
        """The loss and metrics on the validation set, each chunk's weighted by its real rows."""
        sums, total_rows = {}, 0
        for batch, rows in chunks:
            self.prepare(batch, StageTimer())
            logps = self.policy_logps(batch)
            real = {key: value[:rows] for key, value in batch.items()}
            if self.unpaired:
                real["desirable_share"], real["undesirable_share"] = kto_shares(real["desirable"])
            _, metrics = self.sequence_loss(logps[:rows], real["response_mask"].sum(dim=-1), real,
                                            MicroBatchShare(loss=torch.tensor(1.0), tokens=torch.tensor(1.0)))
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value.item() * rows
            total_rows += rows
        return self._with_margins({name: value / total_rows for name, value in sums.items()})
