"""What an RL config needs, read from the config alone: the roles it runs (critic, reference), whether its
advantage estimator can run, and the LR schedules' length. The pre-flight check and the job both ask here, so
neither imports the other."""
from __future__ import annotations

from typing import Callable

from verl_mega.algorithms import estimator_inputs
from verl_mega.config import TrainConfig
from verl_mega.rewards.registry import RewardFn
from verl_mega.roles.actor import uses_kl_loss

# What a step lacks for an estimator input, by config: (the input is missing, the fix). The other inputs
# (rewards, scores, mask, uids, old log-probs, sum pi^2, ReMax's greedy baseline) are computed on demand, and
# both rollout engines return their log-probs with every response (rollout_log_probs).
ESTIMATOR_INPUT_GAPS = {
    "values": (lambda config: not config.critic.enable, "takes the critic's values: set critic.enable=true"),
}
# Estimators whose every prompt group needs two responses or more (verl refuses fewer).
MIN_GROUP_SIZE = {"grpo_passk": 2}


def uses_critic(config: TrainConfig) -> bool:
    return config.job == "rl" and config.algorithm.adv_estimator == "gae" and config.critic.enable


def uses_reference(config: TrainConfig) -> bool:
    """Whether a KL term can be non-zero: in the loss or in the reward, with a non-zero coefficient (the adaptive
    controller scales its coefficient, so one that starts at 0 stays 0). Otherwise the reference pass, and the
    reference's memory, is skipped; so is the `actor/kl` metric, which needs the reference."""
    kl_reward = config.algorithm.use_kl_in_reward and config.algorithm.kl_ctrl.kl_coef != 0
    return uses_kl_loss(config.actor.loss) or kl_reward


def uses_teacher(config: TrainConfig) -> bool:
    """Whether the run distils from a teacher (algorithm.distill.loss), which then scores every response."""
    return config.job == "rl" and config.algorithm.distill.loss != "off"


def teacher_folders(config: TrainConfig) -> dict[str, str]:
    """The distillation teachers' HF folders to convert, by role: `teacher` (teacher.hf_path, where no teacher.ckpt
    replaces it) and `teacher:SOURCE` for each of teacher.by_data_source; none without a distillation loss."""
    if not uses_teacher(config):
        return {}
    teacher = config.teacher
    folders = {"teacher": teacher.hf_path} if teacher.hf_path and not teacher.ckpt else {}
    return {**folders, **{f"{TEACHER_OF}{source}": path for source, path in teacher.by_data_source.items()}}


def model_keys(config: TrainConfig) -> list[tuple[str, ...]]:
    """The paths of the keys naming a model folder (or a Hub id) that this run reads: the actor's, the critic's
    where a critic runs from a folder of its own, an RL job's reward model, and the distillation teachers'.
    What a key the run does not read names is never fetched (`hub.inputs.resolve_inputs`)."""
    keys = [("model", "hf_path")]
    if config.model.critic_hf_path and uses_critic(config):
        keys.append(("model", "critic_hf_path"))
    if config.job == "rl" and config.reward.reward_model:
        keys.append(("reward", "reward_model"))
    if uses_teacher(config):
        keys += [("teacher", "hf_path")] * bool(config.teacher.hf_path)
        keys += [("teacher", "by_data_source", source) for source in config.teacher.by_data_source]
    return keys


TEACHER_OF = "teacher:"  # the role name of a data source's teacher, before the source


def teacher_layout(config: TrainConfig) -> tuple[int, int, int]:
    """Every teacher's (tp, pp, ep): teacher.tp and teacher.pp (null: the student's), at the student's EP."""
    teacher, p = config.teacher, config.parallel
    return (p.tp if teacher.tp is None else teacher.tp, p.pp if teacher.pp is None else teacher.pp, p.ep)


def role_layout(config: TrainConfig, role: str) -> tuple[int, int, int]:
    """The (tp, pp, ep) `role` (actor, critic, teacher or teacher:SOURCE) runs and is converted at."""
    p = config.parallel
    return teacher_layout(config) if role.startswith("teacher") else (p.tp, p.pp, p.ep)


def teacher_alone(config: TrainConfig, reward_fn: RewardFn | None = None) -> bool:
    """Whether the teacher's signal is the whole reward: no reward function (nor the Python API's callable in its
    place), model or service scores the responses."""
    reward = config.reward
    return not (reward_fn or reward.function or reward.reward_model or reward.remote.url)


def uses_greedy_baseline(config: TrainConfig) -> bool:
    """Whether the estimator takes ReMax's baseline: a greedy response per prompt, scored like the samples."""
    return "reward_baselines" in estimator_inputs(config.algorithm.adv_estimator)


def check_estimator_config(config: TrainConfig, need: Callable[[bool, str], None]) -> None:
    """need(ok, problem) for each reason the configured advantage estimator cannot run under `config`: one line
    naming the key and the fix (the pre-flight check's)."""
    name = config.algorithm.adv_estimator
    for input_name in estimator_inputs(name):
        missing, fix = ESTIMATOR_INPUT_GAPS.get(input_name, (lambda _: False, ""))
        need(not missing(config), f"algorithm.adv_estimator={name} {fix}")
    least = MIN_GROUP_SIZE.get(name, 1)
    need(config.rollout.n >= least, f"algorithm.adv_estimator={name} compares the responses to each prompt: set "
         f"rollout.n >= {least}, got rollout.n={config.rollout.n}")


def optimizer_steps(config: TrainConfig, role) -> int:
    """Optimizer steps a role takes over the run: the LR schedule's length (it steps once per mini-batch)."""
    sequences = config.data.batch_size * config.rollout.n
    return config.trainer.total_steps * role.ppo_epochs * (sequences // role.mini_batch_size)
