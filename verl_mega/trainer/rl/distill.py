"""The stages of on-policy distillation (algorithm.distill): the teacher scores the student's responses, then
the teacher's term joins the advantages.

    teacher scores       after the model passes: the teacher's per-token log-probs of the sampled tokens (and its
                         top-k where gkd needs them), and the metrics verl and TRL log for distillation
    distill advantages   after the advantages: reverse_kl adds coef * -(log p_student - log p_teacher) to each
                         token's advantage, or is the whole advantage with reward.function empty (gkd's term is in
                         the actor's loss, over the top-k columns this stage leaves in the batch)
"""
from __future__ import annotations

import torch

from verl_mega.algorithms import distill_advantages, masked_mean
from verl_mega.config import TrainConfig
from verl_mega.rewards.registry import RewardFn
from verl_mega.roles.teacher import Teacher

from .needs import teacher_alone
from .step import Step

# The batch column ModelPasses adds for these metrics (the student's entropy at each sampled token), taken out
# of the batch here: the update computes its own.
STUDENT_ENTROPY = "student_entropy"


def distill_metrics(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                    student_entropy: torch.Tensor | None, teacher_entropy: torch.Tensor,
                    top1_match: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Token means over the responses: the reverse KL estimate log p_student - log p_teacher of the sampled
    tokens, both entropies, and the share of sampled tokens that are the teacher's most likely."""
    metrics = {"distill/reverse_kl": masked_mean(student_log_probs - teacher_log_probs, mask).item(),
               "distill/teacher_entropy": masked_mean(teacher_entropy, mask).item(),
               "distill/top1_agreement": masked_mean(top1_match, mask).item()}
    if student_entropy is not None:
        metrics["distill/student_entropy"] = masked_mean(student_entropy, mask).item()
    return metrics


class TeacherScores:
    """batch['teacher_log_probs'] [B, R] (and, for gkd, 'teacher_topk_ids' and 'teacher_topk_log_probs'
    [B, R, k]); the distillation metrics. `teachers`: by data source, None the teacher of every other source's rows
    (teacher.by_data_source): each scores the whole batch where its source has rows (the same rows on every rank),
    and its rows are taken."""

    def __init__(self, config: TrainConfig, teachers: dict[str | None, Teacher]):
        self.config, self.teachers = config, teachers

    def run(self, step: Step) -> None:
        batch = step.batch
        with step.timer("teacher_log_prob"):
            scores = None
            for source, teacher in self.teachers.items():
                rows = torch.tensor([source is None or row_source == source for row_source in step.rows["data_source"]])
                if rows.any():
                    scores = self.taken(scores, self.score(teacher, batch), rows)
        batch["teacher_log_probs"] = scores["log_probs"].cpu()
        if "topk_ids" in scores:
            batch["teacher_topk_ids"] = scores["topk_ids"].long().cpu()
            batch["teacher_topk_log_probs"] = scores["topk_log_probs"].cpu()
        mask = batch["response_mask"].float()
        student = batch.get("old_log_probs")
        if student is not None:
            step.metrics.update(distill_metrics(student, batch["teacher_log_probs"], batch.pop(STUDENT_ENTROPY, None),
                                                scores["entropy"].cpu(), scores["top1_match"].cpu(), mask))

    def score(self, teacher: Teacher, batch: dict) -> dict[str, torch.Tensor]:
        actor = self.config.actor
        return teacher.score(batch, actor.micro_batch_size, actor.max_tokens_per_micro_batch)

    @staticmethod
    def taken(scores: dict | None, theirs: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """`theirs` in `rows`, `scores` elsewhere (None: `theirs` everywhere)."""
        if scores is None:
            return theirs
        return {name: torch.where(rows.view(-1, *[1] * (value.dim() - 1)).to(value.device), theirs[name], value)
                for name, value in scores.items()}


class DistillAdvantages:
    """reverse_kl: the advantages plus coef times the per-token reverse-KL advantage (discount 0); with no outcome
    reward (reward.function empty), that term alone."""

    def __init__(self, config: TrainConfig, teacher_alone: bool):
        self.coef = config.algorithm.distill.coef
        self.teacher_alone = teacher_alone

    def run(self, step: Step) -> None:
        batch = step.batch
        mask = batch["response_mask"].float()
        outcome = None if self.teacher_alone else batch["advantages"]
        advantages = distill_advantages(outcome, batch["old_log_probs"], batch["teacher_log_probs"], mask,
                                        coef=self.coef)
        batch["advantages"] = advantages.float()
        if self.teacher_alone:  # no critic learns from an outcome here: the returns are the advantages
            batch["returns"] = batch["advantages"]


def distill_stages(config: TrainConfig, teachers: dict[str | None, Teacher], reward_fn: RewardFn | None = None
                   ) -> tuple[list, list]:
    """(the stages after the model passes, those after the advantages) for the config's distillation loss, by the
    `teachers` of each data source (see `TeacherScores`); `reward_fn`: the Python API's callable in place of
    reward.function."""
    loss = config.algorithm.distill.loss
    if not teachers or loss == "off":
        return [], []
    after_advantages = [DistillAdvantages(config, teacher_alone(config, reward_fn))] if loss == "reverse_kl" else []
    return [TeacherScores(config, teachers)], after_advantages
