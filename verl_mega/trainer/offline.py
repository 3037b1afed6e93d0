"""Jobs that train the policy on rows read from files (SFT, preference) rather than on its own generations.

They share the loop, checkpoints and export of `TrainingJob`, the actor role and its megatron step; this adds
the data: examples tokenized and checked up front, length-grouped resumable batches, and validation passes
over `data.val_files` every `trainer.val_every` steps and at the end.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from verl_mega.config import TrainConfig
from verl_mega.data.sampler import ResumableBatchSampler
from verl_mega.data.supervised import Limits, LoadedRows
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.files.plain_state import entry
from verl_mega.models.builder import memory_overrides
from verl_mega.roles.actor import Actor

from .job import TrainingJob
from .metrics import StageTimer, print_note, step_performance


def limits(config: TrainConfig) -> Limits:
    data = config.data
    return Limits(data.max_prompt_length, data.max_response_length, data.truncation)


class OfflineJob(TrainingJob):
    # Batch rows per example: a preference pair is two rows (chosen, rejected).
    rows_per_example = 1

    def build(self, actor_ckpt: Path) -> None:
        """The examples (checked up front), their length-grouped sampler and the actor."""
        config = self.config
        self.actor_ckpt = Path(actor_ckpt)
        self.tokenizer = load_tokenizer(config.model.hf_path)
        data = config.data
        train = self.load_examples(data.train_files)
        self.train_examples = train.examples
        self.val_examples = self.load_examples(data.val_files).examples if data.val_files else []
        if train.skipped and self.layout.rank == 0:
            print_note(f"skipped {train.skipped} invalid rows of data.train_files (data.skip_invalid_rows)",
                       config.trainer.log_format)
        self.sampler = ResumableBatchSampler(len(self.train_examples), data.batch_size, seed=data.seed,
                                             lengths=[self.example_length(e) for e in self.train_examples],
                                             group_batches=data.length_group_batches)
        schedule_steps = config.trainer.total_steps * (data.batch_size // config.actor.mini_batch_size)
        self.actor = Actor(actor_ckpt, config.actor.optim, dtype=config.model.dtype,
                           packed_sequences=config.actor.use_packed_sequences, schedule_steps=schedule_steps,
                           lora=config.actor.lora, **memory_overrides(config.actor, config.parallel))

    # --- what a job defines ---------------------------------------------------------------------------

    def load_examples(self, paths: list[str]) -> LoadedRows:
        raise NotImplementedError

    @staticmethod
    def example_length(example) -> int:
        raise NotImplementedError

    def make_batch(self, examples: list):
        raise NotImplementedError

    def update(self, batch, timer: StageTimer) -> dict[str, float]:
        raise NotImplementedError

    def validation_metrics(self, chunks: Iterable[tuple[dict, int]]) -> dict[str, float]:
        """Metrics over the validation set, given as (batch, number of real rows) chunks."""
        raise NotImplementedError

    # --- the shared parts -----------------------------------------------------------------------------

    @property
    def micro_rows(self) -> int:
        return self.config.actor.micro_batch_size * self.rows_per_example

    def trainables(self) -> dict:
        return {"actor": self.actor.trainable}

    def final_weights(self) -> list[tuple]:
        return [(self.actor.model, self.actor_ckpt, "actor")]

    def job_state(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_job_state(self, state: dict) -> None:
        self.sampler.load_state_dict(entry(state, "sampler", dict, ""))

    def train_step(self) -> dict[str, float]:
        timer = StageTimer()
        batch = self.make_batch([self.train_examples[i] for i in self.sampler.next_batch()])
        metrics = self.update(batch, timer)
        return {**metrics, "data/epoch": self.sampler.epoch,
                **step_performance(timer, batch["attention_mask"].sum().item())}

    def validate(self) -> dict[str, float]:
        if not self.val_examples:
            return {}
        size = self.config.data.batch_size
        with self.progress.phase(f"validation after step {self.step} ({len(self.val_examples)} examples)"):
            batches = self.progress.batches(-(-len(self.val_examples) // size), f"validation after step {self.step}")
            try:
                return self.validation_metrics(self.chunks(self.val_examples, batches.advance))
            finally:
                batches.close()

    def chunks(self, examples: list, advance=lambda: None) -> Iterator[tuple[dict, int]]:
        """`examples` in batches of `data.batch_size` examples, with their number of real rows; the last is filled
        up with copies of its first example (every rank and micro-batch then gets whole rows) that results leave
        out. `advance()` after each batch is used (a validation's progress)."""
        size = self.config.data.batch_size
        for start in range(0, len(examples), size):
            chunk = examples[start:start + size]
            yield self.make_batch(chunk + [chunk[0]] * (size - len(chunk))), len(chunk) * self.rows_per_example
            advance()
