"""What the RL step reports: samples for generations.jsonl, the rollout/training mismatch, and the step's
metrics (rewards, response lengths, skips, weight-push checks, timing)."""
from __future__ import annotations

from typing import Callable

from verl_mega.algorithms import mismatch_metrics_by_source, rollout_correction_from_config
from verl_mega.config import TrainConfig
from verl_mega.roles.actor import Actor
from verl_mega.roles.reward import RewardOutput

from ..metrics import step_performance
from ..rollout_batch import response_tokens
from .scoring import Scoring
from .step import Step


class SampleLog:
    """Every `trainer.log_samples_every` steps, rank 0 appends some of the step's samples to generations.jsonl
    through `log_samples(step_number, samples)`."""

    def __init__(self, config: TrainConfig, rank: int, scoring: Scoring, log_samples: Callable[[int, list], None]):
        self.config, self.rank, self.scoring, self.log_samples = config, rank, scoring, log_samples

    def run(self, step: Step) -> None:
        every = self.config.trainer.log_samples_every
        if every > 0 and step.number % every == 0 and self.rank == 0:
            self.log_samples(step.number, self.sample_rows(step.batch, step.rows, step.reward))

    def sample_rows(self, batch: dict, rows: dict, reward: RewardOutput) -> list[dict]:
        """`trainer.log_samples` rows: the first sample of as many prompts as there are, then their second
        samples, ...; the prompt as the data file gives it, the response (all of a multi-turn episode's tokens,
        and its messages) with special tokens dropped, and a dict reward's extra fields."""
        scores = reward.scores
        n, total = self.config.rollout.n, len(scores)
        chosen = sorted(range(total), key=lambda row: (row % n, row))[:self.config.trainer.log_samples]
        responses = self.scoring.decode(batch["responses"][chosen], response_tokens(batch)[chosen])
        samples = [{"prompt": prompt_text(rows["raw_prompt"][row]), "response": response, "score": scores[row].item()}
                   for row, response in zip(chosen, responses)]
        for row, sample in zip(chosen, samples):
            if rows["data_source"][row] is not None:
                sample["data_source"] = str(rows["data_source"][row])
            sample.update(row_fields(reward, row))
            if "episode" in rows:
                sample["messages"] = rows["episode"][row].messages
        return samples


class Mismatch:
    """`rollout_corr/<metric>` (and `rollout_corr/<metric>/<data_source>`, where rows have one): how far the
    rollout engine's log-probs are from the trainer's on the step's responses, and what the configured correction
    truncated or masked (see `algorithms.mismatch_metrics`). The trainer's are the old-log-prob pass's where it
    ran, else the on-policy update's first forward's (the same numbers: the weights that generated the batch),
    which are the ones the correction used."""

    def __init__(self, config: TrainConfig, actor: Actor):
        self.config, self.actor = config, actor

    def run(self, step: Step) -> None:
        batch = step.batch
        train = batch.get("old_log_probs", self.actor.first_forward_log_probs)
        if "rollout_log_probs" not in batch or train is None:
            return
        rollout, mask = batch["rollout_log_probs"], batch["response_mask"]
        correction = rollout_correction_from_config(train, rollout, mask, self.config.algorithm.rollout_correction)
        sources = [None if source is None else str(source) for source in step.rows["data_source"]]
        step.metrics.update({f"rollout_corr/{name}": value for name, value
                             in mismatch_metrics_by_source(train, rollout, mask, correction, sources).items()})


def step_metrics(step: Step, nonfinite_skipped: int, push_metrics: dict[str, int]) -> dict[str, float]:
    """The step's metrics with its rewards (and a dict reward's fields), response lengths, skip count, weight-push
    checks and performance; a step that sampled nothing to train on logs its sampling and timing."""
    timer = step.timer
    if step.batch is None:
        return {**step.metrics, "trainer/nonfinite_skipped": nonfinite_skipped, **step_performance(timer, 0)}
    lengths = response_tokens(step.batch).sum(dim=-1).float()
    scores = step.reward.scores
    # reward/timeouts is the sampling's: it counts the answers of dropped groups too.
    fields = {f"reward/{name}": values.nanmean().item() for name, values in step.reward.extras.items()}
    return {**step.metrics, **fields, "trainer/nonfinite_skipped": nonfinite_skipped,
            "reward/mean": scores.mean().item(), "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
            "response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item(),
            **push_metrics, **step_performance(timer, step.batch["attention_mask"].sum().item())}


def row_fields(reward: RewardOutput, row: int) -> dict:
    """One response's extra fields for its logged sample: the numeric ones it has, then the others."""
    numeric = {name: values[row].item() for name, values in reward.extras.items() if not values[row].isnan()}
    return {**numeric, **reward.sample_fields[row]} if reward.sample_fields else numeric


def prompt_text(prompt: str | list[dict]) -> str:
    """A data row's prompt as one string: chat messages one per line, "role: content"."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{message['role']}: {message['content']}" for message in prompt)
