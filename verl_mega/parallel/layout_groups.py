"""megatron's process groups of a second layout on the same processes: the distillation teacher at its own TP/PP
beside the student's.

megatron-core reads its groups from `parallel_state`'s module globals in more places than its explicit
`pg_collection` arguments reach (the vocabulary-parallel layers' ranks, the pipeline schedules' stage tests,
`sharded_state_dict` offsets when a checkpoint loads), and so does this project (`state.current_layout`, the
log-prob and top-k reductions, the per-token passes). So a second layout is a second set of those globals:
created once by megatron's own `initialize_model_parallel` (every rank creates the same groups in the same order,
as `torch.distributed.new_group` requires) and put in place only while a model of that layout is built or runs.
The student's groups are back outside that block; its modules hold their own groups from their construction
either way."""
from __future__ import annotations

import contextlib
import re

from .layout import ParallelLayout
from .state import current_layout

# parallel_state's module globals: its groups, their ranks and sizes, and the memory buffer it creates with them.
_STATE_NAME = re.compile(r"_[A-Z][A-Z0-9_]*")


def _parallel_state():
    from megatron.core import parallel_state

    return parallel_state


def _saved() -> dict[str, object]:
    module = _parallel_state()
    return {name: value for name, value in vars(module).items() if _STATE_NAME.fullmatch(name)}


def _put_back(state: dict[str, object]) -> None:
    vars(_parallel_state()).update(state)


class LayoutGroups:
    """megatron's groups for (tp, pp, ep) over this process's world (collective: every rank constructs it, in
    the same order as its other groups); `active()` puts them in place for a block."""

    def __init__(self, tp: int, pp: int, ep: int = 1, timeout_minutes: int = 30):
        module = _parallel_state()
        outer = _saved()
        try:
            # As on import (None, or an empty dict of groups), not by `destroy_model_parallel`, which would destroy
            # the outer layout's gloo groups.
            _put_back({name: {} if isinstance(value, dict) else None for name, value in outer.items()})
            module.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, distributed_timeout_minutes=timeout_minutes)
            self._state = _saved()
            self.layout: ParallelLayout = current_layout()
        finally:
            _put_back(outer)

    @contextlib.contextmanager
    def active(self):
        """This layout's groups for megatron and `current_layout` within the block; the outer ones after."""
        outer = _saved()
        _put_back(self._state)
        try:
            yield self.layout
        finally:
            self._state = _saved()  # what megatron set up lazily inside (a memory buffer) is kept for next time
            _put_back(outer)
