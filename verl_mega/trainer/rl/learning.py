"""The stages of the RL step that learn from a scored batch: what the models say of the responses (old and
reference log-probs, values), the advantages (with the KL controller and reward normaliser they own), and the
critic and actor updates."""
from __future__ import annotations

import copy

import torch

from verl_mega.algorithms import (
    RunningMeanStd, apply_kl_penalty, compute_kl, estimator_inputs, estimator_knobs, get_adv_estimator,
    get_kl_controller, masked_mean, old_log_probs_from_rollout, overlong_filtered_mask,
)
from verl_mega.config import TrainConfig
from verl_mega.config.errors import NonFiniteError
from verl_mega.files.plain_state import entry
from verl_mega.roles.actor import is_on_policy

from ..rollout_batch import response_tokens
from .distill import STUDENT_ENTROPY
from .models import Models
from .step import NonFiniteGuard, Step

# An advantage estimator's inputs that the batch holds when the step computed them (see algorithms.advantages).
BATCH_ESTIMATOR_INPUTS = ("values", "old_log_probs", "rollout_log_probs", "sum_pi_squared")


class ModelPasses:
    """Adds the old log-probs (where the update needs a separate pass), the reference's log-probs and the critic's
    values, where the config uses them."""

    def __init__(self, config: TrainConfig, models: Models):
        self.config, self.models = config, models

    def run(self, step: Step) -> None:
        batch, timer, models = step.batch, step.timer, self.models
        actor, critic = self.config.actor, self.config.critic
        micro, actor_tokens = actor.micro_batch_size, actor.max_tokens_per_micro_batch
        if self.needs_old_log_probs(len(batch["responses"])):
            # The optimal token baseline's sum_v pi_v^2 comes from the same forward as the old log-probs, and so
            # does the student's entropy that distillation logs.
            sum_pi_squared = "sum_pi_squared" in estimator_inputs(self.config.algorithm.adv_estimator)
            with timer("old_log_prob"):
                old = models.actor.compute_log_prob(batch, micro, return_entropy=bool(models.teachers),
                                                    max_tokens=actor_tokens, return_sum_pi_squared=sum_pi_squared)
            renamed = {"log_probs": "old_log_probs", "entropy": STUDENT_ENTROPY}
            batch.update({renamed.get(key, key): value.cpu() for key, value in old.items()})
        if models.reference is not None:
            with timer("ref_log_prob"):
                batch["ref_log_probs"] = models.reference.compute_ref_log_prob(batch, micro, actor_tokens).cpu()
        if models.critic is not None:
            with timer("values"):
                batch["values"] = models.critic.compute_values(batch, critic.micro_batch_size,
                                                               critic.max_tokens_per_micro_batch).cpu()

    def needs_old_log_probs(self, rows: int) -> bool:
        """A separate old-log-prob pass is redundant when the update is on-policy (the actor then takes them from
        its first forward, bitwise the same) or its loss takes the rollout's log-probs as the old ones (bypass
        mode), unless the KL penalty in the reward, the estimator or distillation (the student's side of the reverse
        KL) needs them before the update."""
        actor = self.config.actor
        kl_in_reward = self.models.reference is not None and self.config.algorithm.use_kl_in_reward
        estimator_needs = "old_log_probs" in estimator_inputs(self.config.algorithm.adv_estimator)
        update_needs = not (old_log_probs_from_rollout(actor.loss.policy_loss)
                            or is_on_policy(actor.ppo_epochs, actor.mini_batch_size, rows))
        return kl_in_reward or estimator_needs or update_needs or bool(self.models.teachers)


class Advantages:
    """batch['advantages'] and batch['returns'] from the configured estimator, given the inputs it names (see
    algorithms.advantages) and its knobs from `algorithm.*`; the KL in the reward applied first. Stateful: the
    adaptive KL controller (`kl_ctrl`) and the reward normaliser (`reward_normalizer`)."""

    def __init__(self, config: TrainConfig):
        self.config = config
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.reward_normalizer = RunningMeanStd()

    def state_dict(self) -> dict:
        return {"kl_ctrl": self.kl_ctrl.state_dict(), "reward_normalizer": self.reward_normalizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Both parts from a job state, each checked into a fresh copy first: a bad value is a ValueError naming
        its key, and changes nothing."""
        kl_ctrl, reward_normalizer = copy.copy(self.kl_ctrl), RunningMeanStd(self.reward_normalizer.epsilon)
        kl_ctrl.load_state_dict(entry(state, "kl_ctrl", dict, ""))
        reward_normalizer.load_state_dict(entry(state, "reward_normalizer", dict, ""))
        self.kl_ctrl, self.reward_normalizer = kl_ctrl, reward_normalizer

    def run(self, step: Step) -> None:
        step.metrics.update(self.compute(step.batch, step.reward.scores, step.reward.token_level_rewards,
                                         step.rows["uid"], step.rows.get("reward_baseline")))

    def compute(self, batch: dict, scores: torch.Tensor, token_scores: torch.Tensor, uids: list[int],
                reward_baselines: torch.Tensor | None = None) -> dict[str, float]:
        """Sets the batch's advantages and returns; the KL and baseline metrics."""
        algorithm = self.config.algorithm
        mask = batch["response_mask"].float()
        metrics = {}
        if algorithm.normalize_rewards:
            self.reward_normalizer.update(scores)
            token_scores = self.reward_normalizer.normalize(token_scores, shift_mean=False) * mask
            if reward_baselines is not None:  # the baseline is a reward: the same scale
                reward_baselines = self.reward_normalizer.normalize(reward_baselines, shift_mean=False)
        token_rewards = token_scores
        if "ref_log_probs" in batch and "old_log_probs" in batch:
            kl = masked_mean(compute_kl(batch["old_log_probs"], batch["ref_log_probs"], algorithm.kl_penalty), mask)
            metrics["actor/kl"] = kl.item()
        if algorithm.use_kl_in_reward and "ref_log_probs" in batch:
            token_rewards, current_kl = apply_kl_penalty(token_scores, batch["old_log_probs"], batch["ref_log_probs"],
                                                         mask, kl_coef=self.kl_ctrl.value,
                                                         estimator=algorithm.kl_penalty)
            self.kl_ctrl.update(current_kl.item(), n_steps=len(uids))
            metrics["actor/kl_coef"] = self.kl_ctrl.value
        if reward_baselines is not None:
            metrics["remax/baseline_mean"] = reward_baselines.mean().item()
        available = {"token_level_rewards": token_rewards, "scores": token_rewards.sum(dim=-1), "response_mask": mask,
                     "index": uids, "reward_baselines": reward_baselines,
                     **{key: batch[key] for key in BATCH_ESTIMATOR_INPUTS if key in batch}}
        name = algorithm.adv_estimator
        missing = [key for key in estimator_inputs(name) if available.get(key) is None]
        if missing:  # the pre-flight check refuses such configs; this names what a custom estimator lacks
            raise ValueError(f"algorithm.adv_estimator={name} takes {', '.join(missing)}, which this step has not "
                             "computed")
        knobs = {knob: getattr(algorithm, knob) for knob in estimator_knobs(name) if hasattr(algorithm, knob)}
        advantages, returns = get_adv_estimator(name)(*(available[key] for key in estimator_inputs(name)), **knobs)
        batch["advantages"], batch["returns"] = advantages.float(), returns.float()
        return metrics


class Updates:
    """The critic's update (with one), then the actor's, on the batch with truncated responses masked out where
    algorithm.overlong_filtering says so. Non-finite gradients stop the run, or skip the rest of that update."""

    def __init__(self, config: TrainConfig, models: Models, guard: NonFiniteGuard, eos_token_ids: list[int]):
        self.config, self.models, self.guard, self.eos_token_ids = config, models, guard, eos_token_ids

    def run(self, step: Step) -> None:
        actor, critic = self.config.actor, self.config.critic
        batch = self.without_overlong(step.batch)
        if self.models.critic is not None:
            with step.timer("update_critic"):
                self.update(step, "critic", self.models.critic.update_critic, batch, critic.ppo_epochs,
                            critic.mini_batch_size, critic.micro_batch_size, critic.max_tokens_per_micro_batch)
        with step.timer("update_actor"):
            self.update(step, "actor", self.models.actor.update_policy, batch, actor.ppo_epochs,
                        actor.mini_batch_size, actor.micro_batch_size, actor.max_tokens_per_micro_batch)

    def update(self, step: Step, role: str, update, *args) -> None:
        try:
            step.metrics.update({f"{role}/{key}": value for key, value in update(*args).items()})
        except NonFiniteError as err:
            self.guard.refuse_or_skip(step, f"{role} {err} (lower {role}.optim.lr)")

    def without_overlong(self, batch: dict) -> dict:
        """algorithm.overlong_filtering: the batch the losses see, truncated responses masked out."""
        if not self.config.algorithm.overlong_filtering:
            return batch
        return {**batch, "response_mask": batch["response_mask"] * overlong_filtered_mask(
            batch["responses"], response_tokens(batch), self.eos_token_ids)}
