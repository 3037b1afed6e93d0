"""Running mean/std of a scalar stream, e.g. to normalise rewards across training steps."""

import math

import torch

from verl_mega.algorithms.masked import masked_sum_and_count
from verl_mega.files.plain_state import number


class RunningMeanStd:
    """Mean and unbiased std of everything seen so far, merged batch by batch (Chan et al. 1979).

    Statistics are kept as Python floats in float64, so a long run does not drift and checkpoints are plain.
    """

    def __init__(self, epsilon: float = 1e-8):
        self.epsilon = epsilon
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def var(self) -> float:
        # Until two values are seen the spread is unknown; 1 makes normalize() a pure shift.
        return self.m2 / (self.count - 1) if self.count > 1 else 1.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, values, mask=None, group=None) -> None:
        """Merge in the (unmasked) values; with `group`, merge the whole data-parallel batch on every rank."""
        values = values.detach().to(torch.float64)
        if mask is None:
            mask = torch.ones_like(values)
        total, count = masked_sum_and_count(values, mask, group=group)
        if count.item() == 0:
            return
        batch_mean = total / count
        batch_m2, _ = masked_sum_and_count((values - batch_mean) ** 2, mask, group=group)
        self._merge(count.item(), batch_mean.item(), batch_m2.item())

    def _merge(self, batch_count: float, batch_mean: float, batch_m2: float) -> None:
        total_count = self.count + batch_count
        delta = batch_mean - self.mean
        self.mean += delta * batch_count / total_count
        self.m2 += batch_m2 + delta**2 * self.count * batch_count / total_count
        self.count = total_count

    def normalize(self, values, shift_mean: bool = True):
        """(values - mean) / std with the running statistics; shift_mean=False only rescales."""
        scale = 1.0 / math.sqrt(self.var + self.epsilon)
        return (values - self.mean) * scale if shift_mean else values * scale

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        """The statistics `state_dict` saved, each checked first (finite; count and m2, the spread, >= 0): a bad one
        is a ValueError naming its key (`reward_normalizer.m2=...`), and changes nothing."""
        what = "reward_normalizer"
        count, mean = number(state, "count", what, low=0), number(state, "mean", what)
        m2 = number(state, "m2", what, low=0)
        self.count, self.mean, self.m2 = count, mean, m2
