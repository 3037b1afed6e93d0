"""`verl-mega plot RUN [--out FILE.png]`: one PNG of a run's curves from RUN/metrics.jsonl (reward, train and
validation; KL; response length; time per stage), for a glance at a run without TensorBoard.

`plot_run(run_dir, out=None)` is the function behind it. A metric a run does not log (an SFT run has no
reward, a run without a reference no `actor/kl`) leaves its panel saying so; matplotlib is imported only here.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from verl_mega.config.errors import UserError
from verl_mega.files.atomic import atomic_file
from verl_mega.run.folder import RunFolder

# (title, metrics drawn as lines, a prefix whose every metric is drawn too); names as rl.py / actor.py log them.
PANELS = (
    ("reward", ("reward/mean", "val/reward_mean"), "val/reward_mean/"),
    # To the reference: in the reward (actor/kl) or in the loss (actor/kl_loss, verl's GRPO default); and to the
    # policy that sampled (ppo_kl), zero when the update is on-policy.
    ("KL", ("actor/kl", "actor/kl_loss", "actor/ppo_kl"), None),
    ("response length (tokens)", ("response/length_mean", "val/response_length_mean"), None),
    ("time per stage (s)", ("val/seconds",), "timing/"),
)


def read_metrics(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl. A last line without its newline (being written, or cut by a kill)
    is left out; any other line that is not a record with an integer step is refused, naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: point at a run folder (trainer.run_dir) that has logged a step") \
            from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path} cannot be read: {err}") from None
    records = []
    for number, line in enumerate(text.split("\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or type(record.get("step")) is not int or not 0 <= record["step"] < 2**53:
            raise UserError(f"{path} line {number} is not a step record (a JSON object with an integer step): "
                            f"{line[:60]!r}")
        records.append(record)
    if not records:
        raise UserError(f"{path} holds no step record yet")
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records where `key` is a finite number."""
    points = [(r["step"], value) for r in records if (value := _finite(r.get(key))) is not None]
    return [step for step, _ in points], [value for _, value in points]


def _finite(value) -> float | None:
    """`value` as a finite float, or None: not a number, a bool, NaN/inf, or an integer too large for a float."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def panel_metrics(records: list[dict]) -> list[tuple[str, list[str], str]]:
    """For each panel: its title, the metrics of `PANELS` it draws that the run logs (a finite value at least
    once), and what it would draw, for the panel that has none."""
    keys = sorted({key for record in records for key in record})
    panels = []
    for title, names, prefix in PANELS:
        candidates = [*names, *(key for key in keys if prefix and key.startswith(prefix) and key not in names)]
        drawn = [key for key in candidates if series(records, key)[0]]
        panels.append((title, drawn, ", ".join([*names, *([f"{prefix}*"] if prefix else [])])))
    return panels


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's PNG to `out` (default RUN/metrics.png) and return its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    folder = RunFolder(run_dir)
    records = read_metrics(folder.metrics)
    out = Path(out) if out is not None else folder.plot
    figure = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(f"{run_dir} (steps {records[0]['step']}-{records[-1]['step']})")
    for axes, (title, drawn, wanted) in zip(figure.subplots(2, 2).flat, panel_metrics(records)):
        for key in drawn:
            steps, values = series(records, key)
            validation = key.startswith("val/")  # a few points, at the validation steps
            axes.plot(steps, values, label=key, marker="o" if validation else None,
                      linestyle="--" if validation and key != "val/reward_mean" else "-")
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        if drawn:
            axes.legend(fontsize="small")
        else:
            axes.text(0.5, 0.5, f"not logged by this run\n({wanted})", ha="center", va="center",
                      transform=axes.transAxes, color="gray")
    try:
        with atomic_file(out) as partial:
            figure.savefig(partial, format="png", dpi=100)
    except OSError as err:
        raise UserError(f"--out {out}: cannot write the plot ({err.strerror or err})") from None
    return out
