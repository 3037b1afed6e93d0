"""What a person watching a run sees before its first step is logged, and through each validation.

Rank 0 prints a line when a phase starts (model loading, conversion, a validation, the first rollout) and when
it ends, with its seconds; a validation also shows how far it is: a progress bar on a terminal when
`trainer.progress_bar` is on, else a line per batch at most every LINE_EVERY_S. Until the first step is logged, a
background thread adds a line whenever HEARTBEAT_S pass with nothing printed, naming the phase still under way:
a first run of a real model is never silent for minutes.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator

from tqdm import tqdm

from .metrics import print_note

HEARTBEAT_S = 30.0  # the longest silence before the first step is logged
LINE_EVERY_S = 10.0  # without a bar: the shortest gap between two lines of a validation's progress


class Progress:
    """`enabled`: this rank prints (rank 0); `bar`: trainer.progress_bar (a bar only where stderr is a
    terminal); `log_format`: trainer.log_format (notes go where print_note puts them)."""

    def __init__(self, enabled: bool, log_format: str = "text", bar: bool = False,
                 heartbeat_s: float = HEARTBEAT_S):
        self.enabled, self.log_format = enabled, log_format
        self.bar = enabled and bar and sys.stderr.isatty()
        self.heartbeat_s = heartbeat_s
        self.current: tuple[str, float] | None = None  # the phase under way and its start
        self.last_line = time.monotonic()
        self._quiet = threading.Event()
        self._thread: threading.Thread | None = None

    def say(self, line: str) -> None:
        if self.enabled:
            print_note(line, self.log_format)
            self.last_line = time.monotonic()

    @contextlib.contextmanager
    def phase(self, what: str, lines: bool = True) -> Iterator[None]:
        """"`what` ..." now, "`what`: done in N s" at the end (`lines`: else the heartbeat's lines only, for a
        phase seldom long); the heartbeat names `what` meanwhile."""
        outer, start = self.current, time.monotonic()
        self.current = (what, start)
        if lines:
            self.say(f"{what} ...")
        try:
            yield
        finally:
            self.current = outer
        if lines:
            self.say(f"{what}: done in {time.monotonic() - start:.1f} s")

    def batches(self, total: int, what: str) -> "BatchProgress":
        """How far a loop of `total` batches is (a validation's): `.advance()` after each."""
        return BatchProgress(self, total, what)

    # --- the heartbeat, until the first step is logged ----------------------------------------------------

    def start_heartbeat(self) -> None:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="progress-heartbeat", daemon=True)
            self._thread.start()

    def stop_heartbeat(self) -> None:
        self._quiet.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _beat(self) -> None:
        while not self._quiet.wait(min(self.heartbeat_s, 1.0)):
            now = time.monotonic()
            if now - self.last_line < self.heartbeat_s:
                continue
            current = self.current
            if current is None:
                self.say("still starting ...")
            else:
                self.say(f"{current[0]}: still running ({now - current[1]:.0f} s so far)")


class BatchProgress:
    """A validation's batches: a tqdm bar on a terminal, else "what: k/n batches (N s)" at most every
    LINE_EVERY_S (and the last one)."""

    def __init__(self, progress: Progress, total: int, what: str):
        self.progress, self.total, self.what = progress, total, what
        self.done, self.start = 0, time.monotonic()
        self.bar = (tqdm(total=total, desc=what, unit="batch", leave=False, file=sys.stderr)
                    if progress.bar else None)

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            self.progress.last_line = time.monotonic()  # the bar is what a person sees move
            return
        now = time.monotonic()
        if now - self.progress.last_line >= LINE_EVERY_S:
            self.progress.say(f"{self.what}: {self.done}/{self.total} batches ({now - self.start:.0f} s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
