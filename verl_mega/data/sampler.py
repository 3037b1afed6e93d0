"""A seeded, resumable batch sampler over dataset indices.

Each epoch's order depends only on (seed, epoch), so the sampler's whole position is three numbers
and a restored run sees exactly the batches an uninterrupted run would have seen. A training job draws one
batch per step with `next_batch()`, which moves on to the next epoch by itself. Or use it as a DataLoader
`batch_sampler` with num_workers=0: worker prefetching draws batches ahead of the training step, and a
checkpointed position would then skip the prefetched batches.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from verl_mega.files.plain_state import count

GENERATOR_SEEDS = 2**64  # torch.Generator.manual_seed takes seeds below it: seed + epoch must stay there


class ResumableBatchSampler:
    """With `lengths`, each epoch's shuffled order is cut into groups of `group_batches` batches, each group is
    sorted by length and its batches are shuffled, so rows of similar length share a batch (less padding)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0, drop_last: bool = True,
                 lengths: Sequence[int] | None = None, group_batches: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if num_samples < (batch_size if drop_last else 1):
            raise ValueError(
                f"{num_samples} samples cannot fill one batch of {batch_size}"
                + (" with drop_last=True" if drop_last else "")
            )
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"{len(lengths)} lengths for {num_samples} samples")
        if group_batches < 1:
            raise ValueError(f"group_batches must be positive, got {group_batches}")
        self.lengths = lengths
        self.group_batches = group_batches
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        # Batches of the current epoch already handed out.
        self.batch_index = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, its order): computed once per epoch

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.num_samples, generator=generator).tolist()
        if self.lengths is None:
            return order
        group = self.batch_size * self.group_batches
        grouped = [index for start in range(0, len(order), group)
                   for index in sorted(order[start:start + group], key=lambda i: self.lengths[i])]
        full = len(grouped) // self.batch_size
        batches = [grouped[b * self.batch_size:(b + 1) * self.batch_size] for b in range(full)]
        # The partial batch, if any, stays last, where drop_last finds it.
        shuffled = [index for b in torch.randperm(full, generator=generator).tolist() for index in batches[b]]
        return shuffled + grouped[full * self.batch_size:]

    def next_batch(self) -> list[int]:
        """The next batch, the first of the next epoch once this one is used up (the epoch rolls over on the call
        after its last batch, so a state saved while the caller holds that batch resumes after it)."""
        if self.batch_index >= len(self):
            self._start_next_epoch()
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, self.epoch_order(self.epoch))
        start = self.batch_index * self.batch_size
        # Counted before it is handed out, so a state saved while the caller holds this batch resumes after it.
        self.batch_index += 1
        return self._order[1][start : start + self.batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        """Yields the rest of the current epoch, then moves on to the next epoch."""
        if self.batch_index >= len(self):
            self._start_next_epoch()
        while self.batch_index < len(self):
            yield self.next_batch()
        self._start_next_epoch()

    def _start_next_epoch(self) -> None:
        self.epoch += 1
        self.batch_index = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The position `state_dict` saved, checked first (`check_state_dict`)."""
        self.epoch, self.batch_index, self.seed = self.check_state_dict(state)

    def check_state_dict(self, state: dict[str, int]) -> tuple[int, int, int]:
        """(epoch, batch index, seed) of a saved position, each checked: one out of range is a ValueError naming
        its key (`sampler.batch_index=...`); nothing changes here."""
        what = "sampler"
        # The saved seed wins: the checkpointed run's order is the one to continue.
        seed = count(state, "seed", what, high=GENERATOR_SEEDS - 1)
        epoch = count(state, "epoch", what, high=GENERATOR_SEEDS - 1 - seed, note=" (seed + epoch seeds the order)")
        batch_index = count(state, "batch_index", what, high=len(self),
                            note=f" (an epoch of {self.num_samples} samples has {len(self)} batches)")
        return epoch, batch_index, seed
