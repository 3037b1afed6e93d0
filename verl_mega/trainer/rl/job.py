"""The RL job: the policy learns from its own generations (PPO, GRPO, RLOO, ...). `build` wires the parts from
the config; `train_step` hands one `Step` record to each stage in turn, in dataflow order:

    sampling       prompts -> HybridEngine transition -> generate -> one row per response -> rewards
                   [-> dynamic sampling: drop groups without signal, generate again until the batch is full]
    model passes   old / reference log-probs, values
    teacher        on-policy distillation: the teacher's log-probs of the responses (distill.py)
    sample log     generations.jsonl
    finite reward  NaN/inf in the reward ends the step (or the run: trainer.nonfinite)
    advantages     the KL in the reward, the estimator [, the teacher's reverse KL]
    finite outputs NaN/inf in the models' outputs or the advantages ends the step
    updates        critic, then actor (overlong filtering)
    mismatch       rollout/training log-prob mismatch
    batch stats    verl's data metrics: lengths, clip ratios, advantages, returns, values

A stage that ends the step leaves the later ones out; the rollout schedule then settles and the step's metrics
are reported. Every rank runs the same stages on the same global batch; the roles take their own data-parallel
slices. Validation (data.val_files) runs the same transition and engine, greedily, before the first step too.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from verl_mega.config.errors import UserError
from verl_mega.data.prompts import PromptDataset
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.parallel.bridge import Bridge
from verl_mega.parallel.layout import RolePlacement
from verl_mega.rewards.registry import RewardFn

from ..job import TrainingJob
from .batch_stats import BatchStats
from .distill import distill_stages
from .generation import Generation
from .learning import Advantages, ModelPasses, Updates
from .models import build_models
from .reporting import Mismatch, SampleLog, step_metrics
from .sampling import Sampling
from .scoring import Scoring
from .step import FiniteOutputs, FiniteReward, NonFiniteGuard, Stage, Step
from .validation import Validation


class RLJob(TrainingJob):
    name = "rl"
    validates_before_training = True

    def build(self, actor_ckpt: Path, critic_ckpt: Path | None = None, reward_fn: RewardFn | None = None,
              bridge: Bridge | None = None, placement: RolePlacement | None = None,
              teacher_ckpts: dict[str | None, Path] | None = None) -> None:
        """The prompts, the models, the reward and the rollout engine behind the HybridEngine, or with rollout
        ranks of their own (`bridge` and `placement`), the client that pushes the weights to them and asks them to
        generate; then the stages over them. `reward_fn`: a callable in place of `reward.function` (the Python
        API's). `teacher_ckpts`: the distillation teachers' converted checkpoints by data source (None: every other
        source's)."""
        config = self.config
        tokenizer = load_tokenizer(config.model.hf_path)
        dataset = self.prompts(tokenizer, "train_files")
        val_dataset = self.prompts(tokenizer, "val_files") if config.data.val_files else None
        self.models = build_models(config, actor_ckpt, critic_ckpt, teacher_ckpts)
        after_passes, after_advantages = distill_stages(config, self.models.teachers, reward_fn)
        scoring = Scoring.build(config, tokenizer, self.layout.world_size, self.note, reward_fn)
        self.generation = Generation.build(config, self.layout, tokenizer, self.hf_config, self.family,
                                           self.models, bridge, placement)
        self.scoring = scoring
        self.rolled_out = False  # this process's first rollout says when it starts and ends
        self.advantages = Advantages(config)
        self.sampling = Sampling(config, dataset, self.generation, scoring, tokenizer.pad_token_id, self.note,
                                 self.hf_config.vocab_size)
        self.validation = (Validation(config, val_dataset, self.generation, scoring, tokenizer.pad_token_id)
                           if val_dataset is not None else None)
        guard = NonFiniteGuard(config.trainer.nonfinite, self.count_skip)
        self.stages: list[Stage] = [
            self.sampling,
            ModelPasses(config, self.models),
            *after_passes,
            SampleLog(config, self.layout.rank, scoring, lambda number, samples: self.logger.log_samples(number,
                                                                                                          samples)),
            FiniteReward(guard, scoring.source),
            self.advantages,
            *after_advantages,
            FiniteOutputs(guard),
            Updates(config, self.models, guard, self.generation.eos_token_ids),
            Mismatch(config, self.models.actor),
            BatchStats(config),
        ]

    def prompts(self, tokenizer, files_key: str) -> PromptDataset:
        """data.train_files or data.val_files as prompts; every problem is in the files the user listed."""
        data = self.config.data
        try:
            return PromptDataset(getattr(data, files_key), tokenizer, data.max_prompt_length, data.prompt_key,
                                 data.truncation)
        except (OSError, ValueError) as err:
            raise UserError(f"data.{files_key}: {err}") from None

    def train_step(self) -> dict[str, float]:
        step = Step(self.step)
        first_rollout, self.rolled_out = not self.rolled_out, True
        for stage in self.stages:
            with (self.progress.phase(f"step {self.step + 1}: the first rollout ({self.config.data.batch_size} "
                                      f"prompts x {self.config.rollout.n})")
                  if first_rollout and stage is self.sampling else contextlib.nullcontext()):
                stage.run(step)
            if step.ended:
                break
        self.sampling.settle()
        return step_metrics(step, self.nonfinite_skipped, self.generation.push_metrics())

    def validate(self) -> dict[str, float]:
        return self.validation.run(self.step, self.progress) if self.validation is not None else {}

    def note(self, step_number: int, message: str) -> None:
        self.logger.note(step_number, message)

    def count_skip(self, step_number: int, problem: str) -> None:
        """trainer.nonfinite=skip dropped a batch or an optimizer step."""
        self.nonfinite_skipped += 1
        self.note(step_number, f"skipped: {problem}")

    # --- checkpoints: each stateful part's keys of trainer_state.json -----------------------------------

    def trainables(self) -> dict:
        return self.models.trainables()

    def final_weights(self) -> list[tuple]:
        return self.models.final_weights()

    def job_state(self) -> dict:
        return {**self.sampling.state_dict(), **self.advantages.state_dict()}

    def load_job_state(self, state: dict) -> None:
        # The in-process part first: the sampling's may send partial rollouts on to the rollout ranks.
        self.advantages.load_state_dict(state)
        self.sampling.load_state_dict(state)

    def close(self) -> None:
        self.generation.close()
        self.scoring.close()
