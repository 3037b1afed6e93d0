"""The RL job as parts: `job.RLJob` builds the stages of a step from the config and runs them in order over one
`step.Step` record (see `job`'s docstring for the order and docs/concepts.md for what each reads and writes)."""
from .job import RLJob

__all__ = ["RLJob"]
