"""The RL step's record, what a stage is, and the non-finite guard.

A step is one `Step` handed to each stage in turn (`RLJob.stages`): a stage reads what earlier ones wrote and
adds its own (the batch's columns, metrics), or ends the step (`ended`) when there is nothing left to do: no
group to train on, or NaN/inf where the guard skips the batch. A stage that holds state across steps (the
sampler, the KL controller) is also `Stateful`: the job saves what it returns in the checkpoint's
trainer_state.json, under keys of its own.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import torch

from verl_mega.config.errors import NonFiniteError
from verl_mega.parallel.agree import all_finite
from verl_mega.roles.reward import RewardOutput

from ..metrics import StageTimer

Note = Callable[[int, str], None]  # (1-based step, message): a line of the run's log


@dataclasses.dataclass
class Step:
    """One RL step as its stages fill it in. `index`: the optimizer steps taken before it (0-based: the weights'
    version that samples it); `batch`: the rows' tensors the models and losses read (None until sampled, or when
    nothing was kept); `rows`: their per-row fields (prompts, uids, data sources, episodes); `reward`: their
    scores; `metrics`: what the step logs, in the order the stages add it."""

    index: int
    timer: StageTimer = dataclasses.field(default_factory=StageTimer)
    batch: dict | None = None
    rows: dict = dataclasses.field(default_factory=dict)
    reward: RewardOutput | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    ended: bool = False

    @property
    def number(self) -> int:
        """The step as the log counts it (1-based)."""
        return self.index + 1


class Stage(Protocol):
    """One part of the step: reads and writes the record; later stages skip once it is `ended`."""

    def run(self, step: Step) -> None: ...


class Stateful(Protocol):
    """A part whose state a checkpoint holds: its keys of trainer_state.json."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class NonFiniteGuard:
    """trainer.nonfinite: NaN/inf in what a step computed stops the run (`stop`) or drops the batch (`skip`),
    before anything of the step is applied. `skipped(number, problem)` counts and logs a skip."""

    def __init__(self, policy: str, skipped: Callable[[int, str], None]):
        self.policy, self.skipped = policy, skipped

    def check(self, step: Step, quantities: dict[str, torch.Tensor], hint: str) -> None:
        """Ends the step (skip) or raises, naming the first quantity that is not finite; nothing if all are."""
        if all_finite(quantities.values()):
            return
        name, values = next((name, values) for name, values in quantities.items()
                            if not torch.isfinite(values).all())
        self.refuse_or_skip(step, f"{name} is NaN/inf ({nonfinite_rows(values)}); {hint}")
        step.ended = True

    def refuse_or_skip(self, step: Step, problem: str) -> None:
        if self.policy == "skip":
            self.skipped(step.number, problem)
            return
        raise NonFiniteError(f"step {step.number}: {problem}; stopped before applying it, nothing saved "
                             "(trainer.nonfinite=skip drops such batches instead)")


def nonfinite_rows(values: torch.Tensor) -> str:
    """Which rows of `values` hold NaN/inf, for the error message."""
    rows = (~torch.isfinite(values)).reshape(len(values), -1).any(dim=-1).nonzero().flatten().tolist()
    if not rows:
        return "on another rank"
    first = values[rows[0]].flatten()
    return f"{len(rows)} of {len(values)} rows, first row {rows[0]}: {first[~torch.isfinite(first)][0].item()}"


# The batch's columns the models and the advantage estimator compute, as a non-finite error names them.
COMPUTED_COLUMNS = {"old_log_probs": "the old log-prob", "values": "the value",
                    "ref_log_probs": "the reference log-prob", "teacher_log_probs": "the teacher's log-prob",
                    "advantages": "the advantage", "returns": "the return"}


class FiniteReward:
    """Ends the step (or the run) where some response's reward is NaN/inf; `source` names the reward's config."""

    def __init__(self, guard: NonFiniteGuard, source: str):
        self.guard, self.source = guard, source

    def run(self, step: Step) -> None:
        self.guard.check(step, {"the reward": step.reward.scores}, f"{self.source} must return finite numbers")


class FiniteOutputs:
    """Ends the step (or the run) where the models' outputs or the advantages hold NaN/inf."""

    def __init__(self, guard: NonFiniteGuard):
        self.guard = guard

    def run(self, step: Step) -> None:
        computed = {name: step.batch[key] for key, name in COMPUTED_COLUMNS.items() if key in step.batch}
        self.guard.check(step, computed, "the model's outputs overflowed (lower the learning rates)")
