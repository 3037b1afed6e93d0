"""The models an RL step runs: the actor, and the reference, critic and distillation teacher where the config
uses them, built from their checkpoints in the actor's dtype (the teacher at its own layout where teacher.tp /
teacher.pp say so)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from verl_mega.config import TrainConfig
from verl_mega.models.builder import memory_overrides
from verl_mega.parallel.layout_groups import LayoutGroups
from verl_mega.roles.actor import Actor, sampling_temperature
from verl_mega.roles.critic import Critic
from verl_mega.roles.reference import make_reference
from verl_mega.roles.teacher import Teacher

from .needs import optimizer_steps, teacher_layout, uses_critic, uses_reference, uses_teacher


@dataclasses.dataclass
class Models:
    actor: Actor
    actor_ckpt: Path
    reference: object | None = None  # a Reference, or the actor's own frozen base (LoRA): compute_ref_log_prob
    critic: Critic | None = None
    critic_ckpt: Path | None = None
    teachers: dict[str | None, Teacher] = dataclasses.field(default_factory=dict)  # by data source, None: others'

    def trainables(self) -> dict:
        """name -> TrainableModel saved in step checkpoints."""
        trainables = {"actor": self.actor.trainable}
        if self.critic is not None:
            trainables["critic"] = self.critic.trainable
        return trainables

    def idle_in_rollout(self, config: TrainConfig) -> list[tuple]:
        """(model, optimizer, offload) of what `rollout.training_memory` releases across the colocated rollout
        window: the actor (`actor.offload`) and the critic (`critic.offload`). A reference of its own is on the
        host already outside its pass with `actor.offload.params` (`roles.reference`), and a LoRA actor's
        adapters-off reference is the actor itself."""
        held = [(self.actor.model, self.actor.trainable.optimizer, config.actor.offload)]
        if self.critic is not None:
            held.append((self.critic.model, self.critic.trainable.optimizer, config.critic.offload))
        return held

    def final_weights(self) -> list[tuple]:
        """(model, source checkpoint, role) of each role published for `verl-mega export`."""
        weights = [(self.actor.model, self.actor_ckpt, "actor")]
        if self.critic is not None:
            weights.append((self.critic.model, self.critic_ckpt, "critic"))
        return weights


def build_models(config: TrainConfig, actor_ckpt: Path, critic_ckpt: Path | None = None,
                 teacher_ckpts: dict[str | None, Path] | None = None) -> Models:
    """The critic, the reference and the teacher run in the actor's dtype, whatever their checkpoints were saved
    in; the log-probs of the update, of the KL term and of the teacher are the sampling distribution's
    (logits / temperature)."""
    dtype, packed, replay = config.model.dtype, config.actor.use_packed_sequences, config.actor.router_replay
    temperature = sampling_temperature(config.rollout.temperature)
    actor_memory = memory_overrides(config.actor, config.parallel)
    actor = Actor(actor_ckpt, config.actor.optim, config.actor.loss, dtype=dtype,
                  schedule_steps=optimizer_steps(config, config.actor), packed_sequences=packed,
                  temperature=temperature, correction=config.algorithm.rollout_correction, router_replay=replay,
                  lora=config.actor.lora, distill=config.algorithm.distill, **actor_memory)
    models = Models(actor, Path(actor_ckpt))
    models.reference = make_reference(actor_ckpt, use_kl=uses_reference(config), actor=actor, dtype=dtype,
                                      packed_sequences=packed, temperature=temperature, router_replay=replay,
                                      offload_params=config.actor.offload.params, **actor_memory)
    if uses_critic(config):
        models.critic_ckpt = Path(critic_ckpt or actor_ckpt)
        models.critic = Critic(models.critic_ckpt, config.critic.optim, config.critic.loss, dtype=dtype,
                               packed_sequences=config.critic.use_packed_sequences,
                               schedule_steps=optimizer_steps(config, config.critic), lora=config.critic.lora,
                               **memory_overrides(config.critic, config.parallel))
    if uses_teacher(config):
        top_k = config.algorithm.distill.top_k if config.algorithm.distill.loss == "gkd" else 0
        tp, pp, ep = teacher_layout(config)
        # At its own layout, the teachers' groups: created once, by every rank (new_group is collective).
        groups = LayoutGroups(tp, pp, ep) if (tp, pp) != (config.parallel.tp, config.parallel.pp) else None
        # Sequence parallelism needs TP: a teacher at TP 1 runs without it whatever the student does.
        teacher_parallel = dataclasses.replace(config.parallel, tp=tp, pp=pp,
                                               sequence_parallel=config.parallel.sequence_parallel and tp > 1)
        memory = memory_overrides(config.actor, teacher_parallel)
        models.teachers = {source: Teacher(ckpt, top_k=top_k, packed_sequences=packed, temperature=temperature,
                                           groups=groups, dtype=dtype, **memory)
                           for source, ckpt in teacher_ckpts.items()}
    return models

