"""A run folder's layout, named once: every path the jobs, export, plot, the API and the demo read or write.

    RUN/config.yaml                         the resolved config (each step checkpoint keeps its own copy)
    RUN/provenance.json                     what the run started from (run/provenance.py)
    RUN/.lock                               held by the live run (run/lock.py)
    RUN/metrics.jsonl, generations.jsonl    a JSON record per logged step; sampled generations
    RUN/metrics.png                         `verl-mega plot`
    RUN/tensorboard/                        tensorboard's event files
    RUN/checkpoints/step_000012/            step checkpoints (run/checkpoints.py)
    RUN/.mirror_pending/step_000012/        snapshots waiting for upload to the mirror (run/mirror.py)
    RUN/final_actor/, final_critic/         each role's final weights, for `verl-mega export`
    RUN/initial_actor_tp1_pp1_ep1/          the converted checkpoint a role starts from, one per layout
    RUN/initial_teacher_tp1_pp1_ep1_<sha>/  the distillation teacher's, at its layout (<sha>: its sha256's first 16)
    RUN/profile/step_000003_rank0.pt.trace.json   a profiled step's trace
    RUN/reference_logprobs.safetensors      the preference job's reference log-prob cache

These names are the on-disk format users and their scripts rely on: `verl-mega export --ckpt RUN` finds the final
weights by them, and a moved run folder resumes by them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePath

from verl_mega.checkpoint.roles import check_role

CONFIG_FILE = "config.yaml"
STATE_FILE = "trainer_state.json"  # a step checkpoint's trainer state (step, sampler, ...): export looks for it
_STEP_NAME = re.compile(r"^step_(\d{6,})$")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_step(path: PurePath) -> int | None:
    """The step of a folder named `step_NNNNNN`, None for any other name."""
    match = _STEP_NAME.match(path.name)
    return int(match.group(1)) if match else None


def layout_name(tp: int, pp: int, ep: int) -> str:
    """How a parallel layout is spelled in folder names (a role's initial conversion, the conversion cache)."""
    return f"tp{tp}_pp{pp}_ep{ep}"


@dataclass(frozen=True)
class RunFolder:
    """The paths of the run folder at `root` (nothing is created or read here)."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def provenance(self) -> Path:
        return self.root / "provenance.json"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def generations(self) -> Path:
        return self.root / "generations.jsonl"

    @property
    def plot(self) -> Path:
        return self.root / "metrics.png"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def step(self, step: int) -> Path:
        """The folder of step `step`'s checkpoint."""
        return self.checkpoints / step_name(step)

    @property
    def mirror_pending(self) -> Path:
        return self.root / ".mirror_pending"

    def final_weights(self, role: str) -> Path:
        """`role`'s weights at the end of the run (actor or critic)."""
        return self.root / f"final_{check_role(role)}"

    def initial_weights(self, role: str, layout: str) -> Path:
        """The run's conversion of `role`'s HF model at `layout` (`layout_name`)."""
        return self.root / f"initial_{check_role(role)}_{layout}"

    def teacher_weights(self, layout: str, checksum: str) -> Path:
        """The run's conversion of the distillation teacher's HF model (teacher.hf_path) at `layout`; `checksum`
        (its sha256) in the name: a run resumed with another teacher converts that one."""
        return self.root / f"initial_teacher_{layout}_{checksum[:16]}"

    def initial_conversions(self, role: str) -> list[Path]:
        """Every layout's initial conversion of `role` in the folder, by name."""
        return sorted(self.root.glob(f"initial_{check_role(role)}_*"))

    def profile_trace(self, step: int, rank: int) -> Path:
        return self.root / "profile" / f"{step_name(step)}_rank{rank}.pt.trace.json"

    @property
    def reference_logprobs(self) -> Path:
        return self.root / "reference_logprobs.safetensors"
