"""Per-step metrics: one compact console line (or one JSON line), a JSONL file in the run folder, TensorBoard,
wandb if set; sample generations beside them."""
from __future__ import annotations

import contextlib
import gc
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch

from verl_mega.files.atomic import atomic_write_text
from verl_mega.rollout.live_bytes import LiveBytes
from verl_mega.run.folder import RunFolder
CONSOLE_KEYS = ("reward/mean", "val/reward_mean", "response/length_mean", "actor/pg_loss", "actor/kl", "critic/vf_loss",
                "actor/entropy", "actor/grad_norm", "sft/loss", "preference/loss",
                "preference/rewards/accuracy", "val/loss",
                "perf/step_seconds")


class StageTimer:
    """Wall time of the named stages of one step (`with timer("rollout"): ...`), and of the whole step since
    the timer was made: wall and this process's CPU time (the latter barely moves when a shared machine is
    busy, so it compares runs made under different loads)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._wall_start, self._cpu_start = time.perf_counter(), time.process_time()

    def elapsed(self) -> tuple[float, float]:
        """(wall, CPU) seconds since the timer was made."""
        return time.perf_counter() - self._wall_start, time.process_time() - self._cpu_start

    @contextlib.contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start)

    def add(self, stage: str, seconds: float) -> None:
        """Count `seconds` spent elsewhere (another process's share of the step) under `stage`."""
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


def peak_rss_bytes() -> int:
    """The process's peak resident host memory since it started, on CPU and GPU machines alike (a GPU's memory is
    `PeakMemory`'s perf/max_memory_* metrics)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """`with PeakMemory(enabled) as memory:` around a step, then `memory.metrics()`: the step's peak memory of
    this rank, in verl's names (empty when not `enabled`). On a GPU the CUDA allocator's peaks since the step
    began. On CPU, where there are no allocator statistics: the tensors alive when the step begins (their
    storage, found by the garbage collector) plus the peak of the storage the step allocates and keeps alive
    (`LiveBytes`); torch's CPU allocator keeps no cache, so what is reserved is what is allocated."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._allocated = self._reserved = 0
        self._tracker = None

    def __enter__(self) -> PeakMemory:
        if not self.enabled:
            return self
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            return self
        self._allocated = live_tensor_bytes()
        self._tracker = LiveBytes().__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        if not self.enabled:
            return
        if self._tracker is None:
            self._allocated, self._reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            return
        self._tracker.__exit__(*exc_info)
        self._allocated += self._tracker.peak
        self._reserved, self._tracker = self._allocated, None

    def metrics(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        return {"perf/max_memory_allocated_gb": self._allocated / 1024**3,
                "perf/max_memory_reserved_gb": self._reserved / 1024**3}


def live_tensor_bytes() -> int:
    """The bytes of the distinct storages of every tensor the garbage collector tracks (parameters, gradient
    buffers, optimizer state, batches)."""
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance asks a weakref proxy for its referent's class, and a dead proxy
        # raises; a live one's tensor is tracked itself.
        if issubclass(type(obj), torch.Tensor) and obj.layout == torch.strided and not obj.is_meta:
            storage = obj.untyped_storage()
            try:
                pointer = storage.data_ptr()
            except RuntimeError:  # a tracing tensor (a FunctionalTensor of torch.compile's): no memory of its own
                continue
            if pointer:  # a FakeTensor's reads 0, an empty storage's too: neither holds a byte
                storages[pointer] = storage.nbytes()
    return sum(storages.values())


def step_performance(timer: StageTimer, tokens: int) -> dict[str, float]:
    """Every job's perf/ and timing/ metrics of a step: wall and CPU seconds since `timer` was made, `tokens`
    (the batch's attended tokens) per second, the process's peak host memory, and each stage's seconds."""
    seconds, cpu_seconds = timer.elapsed()
    return {"perf/step_seconds": seconds, "perf/step_cpu_seconds": cpu_seconds,
            "perf/tokens_per_second": tokens / seconds, "perf/peak_rss_gib": peak_rss_bytes() / 1024**3,
            **{f"timing/{stage}": value for stage, value in timer.seconds.items()}}


def print_note(message: str, log_format: str) -> None:
    """A remark about the run (a conversion, a resume, a skipped batch): on stdout beside the text step lines; on
    stderr under `trainer.log_format: json`, where stdout holds step records only."""
    print(message, file=sys.stdout if log_format == "text" else sys.stderr, flush=True)

class MetricsLogger:
    """Only rank 0 writes; `log(step, metrics)` appends one JSON line and prints one line: a compact one
    (`log_format="text"`), or the record itself as JSON (`"json"`, for cluster log collectors; the only thing
    printed on stdout per step, notes go to stderr)."""

    def __init__(self, run_dir: str | Path, *, enabled: bool, tensorboard: bool = True, wandb_project: str = "",
                 config: dict | None = None, log_format: str = "text"):
        self.enabled = enabled
        self.log_format = log_format
        self._writer = self._wandb = None
        if not enabled:
            return
        folder = RunFolder(run_dir)
        self.jsonl, self.generations = folder.metrics, folder.generations
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(folder.tensorboard))
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=str(folder.root), config=config)

    @staticmethod
    def truncate(run_dir: str | Path, step: int) -> None:
        """Drop records and samples after `step` (a resumed run logs those steps again)."""
        folder = RunFolder(run_dir)
        for path in (folder.metrics, folder.generations):
            if path.is_file():
                kept = [line for line in path.read_text().splitlines() if _step_of(line) <= step]
                atomic_write_text(path, "".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        with self.jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if self.log_format == "json":
            print(json.dumps(record), flush=True)
        else:
            shown = " ".join(f"{key.split('/')[-1]}={_console(record[key])}" for key in CONSOLE_KEYS if key in record)
            print(f"step {step}: {shown}", flush=True)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Append `samples` (prompt / response / score rows) to generations.jsonl, each with its step; a table
        in TensorBoard's text tab and in wandb."""
        if not self.enabled or not samples:
            return
        rows = [{"step": step, **{key: _plain(value) for key, value in sample.items()}} for sample in samples]
        with self.generations.open("a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
        columns = list(rows[0])
        if self._writer is not None:
            header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
            lines = ["| " + " | ".join(_markdown_cell(row.get(column)) for column in columns) + " |" for row in rows]
            self._writer.add_text("samples", header + "\n".join(lines), step)
            self._writer.flush()
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=columns, data=[[row.get(column) for column in columns] for row in rows])
            self._wandb.log({"samples": table}, step=step)

    def note(self, step: int, message: str) -> None:
        """A remark about a step (a skipped batch)."""
        if self.enabled:
            print_note(f"step {step}: {message}", self.log_format)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(value):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, (int, float)):  # JSON has no NaN/inf: a skipped batch's NaN reward is logged as null
        return float(value) if math.isfinite(value) else None
    return value


def _markdown_cell(value) -> str:
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


def _console(value) -> str:
    return "nan" if value is None else f"{value:.4g}"


def _step_of(line: str) -> float:
    """A record's step; a line cut short by a kill, or not a record at all, sorts after every step (dropped)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
    return step if isinstance(step, int) else math.inf
