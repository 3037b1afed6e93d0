"""A short RL job in this process (a world of one) whose rollout engine and training-memory release are wrapped
to record their calls in order, each step's and each validation pass's after a marker; written as JSON.

    python -m tests.transition_order_worker OUT.json --config FILE.yaml [key=value ...]

The engine and the release context are the real ones: the wrappers only note each call, then make it.
"""
import contextlib
import json
import sys

from verl_mega.parallel.process_exit import exit_process
from verl_mega.trainer import rl as job_module
from verl_mega.trainer.main import main

RECORDED = ("wake_up", "load_weights", "generate", "sleep")
calls: list[str] = []


class RecordingEngine:
    """The real engine, its transitions and generation noted in `calls` (wake-ups with their tags)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        attribute = getattr(self._engine, name)
        if name not in RECORDED:
            return attribute

        def recorded(*args, **kwargs):
            calls.append(f"wake_up:{','.join(args[0])}" if name == "wake_up" else name)
            return attribute(*args, **kwargs)

        return recorded


def recording_engine_factory(make_engine):
    return lambda *args, **kwargs: RecordingEngine(make_engine(*args, **kwargs))


def recording_release(release):
    @contextlib.contextmanager
    def released(*args, **kwargs):
        with release(*args, **kwargs):
            calls.append("release")
            yield
            calls.append("restore")

    return released


def marked(method, marker: str):
    def run(self, *args, **kwargs):
        calls.append(marker)
        return method(self, *args, **kwargs)

    return run


if __name__ == "__main__":
    job = job_module.RLJob
    job_module.make_rollout_engine = recording_engine_factory(job_module.make_rollout_engine)
    job_module.training_memory_released = recording_release(job_module.training_memory_released)
    job.train_step = marked(job.train_step, "train_step")
    job.validate = marked(job.validate, "validate")
    code = main(sys.argv[2:])
    with open(sys.argv[1], "w") as out:
        json.dump(calls, out)
    exit_process(code)
