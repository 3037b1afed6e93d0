"""The RL job: the policy learns from its own generations (PPO, GRPO, RLOO, ...). Every rank runs the same loop
on the same global batch; the roles take their own data-parallel slices, so `train_step` reads as the dataflow
it runs, one named stage after the other:

    sample prompts -> HybridEngine transition -> generate (tokens and their rollout log-probs) -> one row per
    response -> rewards (overlong penalty) [-> dynamic sampling: drop groups without signal, generate again until
    the batch is full] -> old/ref log-probs, values -> advantages -> critic and actor updates (overlong filtering)
    -> rollout/training mismatch -> metrics

A stage that finds NaN/inf ends the step before anything is applied (or stops the run: `trainer.nonfinite`).

Validation (data.val_files) runs the same transition and engine, decoding greedily, and scores with the same
reward; it starts before the first step, so the curve shows where training began.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from verl_mega.algorithms import (
    BatchNotFilled, GroupFilter, RunningMeanStd, apply_kl_penalty, compute_kl, estimator_inputs, estimator_knobs,
    get_adv_estimator, get_kl_controller, masked_mean, mismatch_metrics_by_source, old_log_probs_from_rollout,
    overlong_filtered_mask, overlong_penalty, rollout_correction, trainable_groups, truncated_responses,
)
from verl_mega.algorithms.staleness import staleness_metrics
from verl_mega.config import TrainConfig
from verl_mega.config.errors import NonFiniteError, UserError
from verl_mega.data.prompts import PromptDataset, as_messages
from verl_mega.data.sampler import ResumableBatchSampler
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.models.builder import DTYPES
from verl_mega.parallel.agree import all_finite
from verl_mega.parallel.bridge import Bridge
from verl_mega.parallel.layout import rollout_placement
from verl_mega.parallel.placement import Placement
from verl_mega.rewards.registry import RewardFn
from verl_mega.roles.actor import Actor, is_on_policy, sampling_temperature, uses_kl_loss
from verl_mega.roles.critic import Critic
from verl_mega.roles.reference import make_reference
from verl_mega.roles.reward import HFRewardModel, RewardOutput, RuleReward, episode_fields, scores_to_token_rewards
from verl_mega.rollout.agent_loop import AgentLoop, episode_metrics
from verl_mega.rollout.engine import EpisodeInfo, Response, SamplingParams
from verl_mega.rollout.factory import make_rollout_engine, resolve_rollout_dtype
from verl_mega.rollout.hybrid_engine import HybridEngine
from verl_mega.rollout.training_memory import training_memory_released
from verl_mega.tools import ToolSet

from .job import TrainingJob
from .metrics import StageTimer, step_performance
from .partial_schedule import LocalChunks, PartialSchedule
from .rollout_batch import ROLLOUT_VERSIONS, build_rollout_batch, response_tokens
from .rollout_schedule import GeneratedRound, Pending, RolloutSchedule, Schedule
from .rollout_service import RemoteChunks, RemoteRollout

# An advantage estimator's inputs that the batch holds when the step computed them (see algorithms.advantages).
BATCH_ESTIMATOR_INPUTS = ("values", "old_log_probs", "rollout_log_probs", "sum_pi_squared")
# The batch's columns the models and the advantage estimator compute, as a non-finite error names them.
COMPUTED_COLUMNS = {"old_log_probs": "the old log-prob", "values": "the value",
                    "ref_log_probs": "the reference log-prob", "advantages": "the advantage", "returns": "the return"}
PROMPT_FIELDS = ("raw_prompt", "reward_model", "data_source", "extra_info")  # what the reward and samples read
# Seeds of a step's later generation rounds (dynamic sampling) sit this far apart, above any step's first-round
# seed: each (step, round, replica) samples its own stream, the same on resume.
ROUND_SEED_STRIDE = 2**31


def uses_critic(config: TrainConfig) -> bool:
    return config.job == "rl" and config.algorithm.adv_estimator == "gae" and config.critic.enable


# What a step lacks for an estimator input, by config: (the input is missing, the fix). The other inputs
# (rewards, scores, mask, uids, old log-probs, sum pi^2, ReMax's greedy baseline) are computed on demand, and
# both rollout engines return their log-probs with every response (rollout_log_probs).
ESTIMATOR_INPUT_GAPS = {
    "values": (lambda config: not config.critic.enable, "takes the critic's values: set critic.enable=true"),
}
# Estimators whose every prompt group needs two responses or more (verl refuses fewer).
MIN_GROUP_SIZE = {"grpo_passk": 2}


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


def uses_reference(config: TrainConfig) -> bool:
    """Whether a KL term can be non-zero: in the loss or in the reward, with a non-zero coefficient (the adaptive
    controller scales its coefficient, so one that starts at 0 stays 0). Otherwise the reference pass, and the
    reference's memory, is skipped; so is the `actor/kl` metric, which needs the reference."""
    kl_reward = config.algorithm.use_kl_in_reward and config.algorithm.kl_ctrl.kl_coef != 0
    return uses_kl_loss(config.actor.loss) or kl_reward


def one_row_per_response(prompts: dict[str, list], n: int) -> dict[str, list]:
    """Each prompt's fields repeated for its `n` samples, in the order the engine returns the responses."""
    return {key: [value for value in values for _ in range(n)] for key, values in prompts.items()}


def rollout_seed(base: int, step: int, gen_round: int, replicas: int, replica: int) -> int:
    """The sampling seed of a replica's generation round in a step (0-based step and round): a pure function of
    them, so a resumed run draws what the uninterrupted one drew; round 0 keeps the seeds runs had before
    dynamic sampling."""
    return base + step * replicas + replica + gen_round * ROUND_SEED_STRIDE


class RLJob(TrainingJob):
    name = "rl"
    validates_before_training = True

    def build(self, actor_ckpt: Path, critic_ckpt: Path | None = None, reward_fn: RewardFn | None = None,
              bridge: Bridge | None = None, placement: Placement | None = None) -> None:
        """The prompts, the actor (and the reference and critic the config uses), the reward and the rollout
        engine behind the HybridEngine, or with rollout ranks of their own (`bridge` and `placement`), the client
        that pushes the weights to them and asks them to generate. `reward_fn`: a callable in place of
        `reward.function` (the Python API's)."""
        config = self.config
        self.actor_ckpt = Path(actor_ckpt)
        self.tokenizer = load_tokenizer(config.model.hf_path)
        try:
            self.dataset = PromptDataset(config.data.train_files, self.tokenizer, config.data.max_prompt_length,
                                         config.data.prompt_key, config.data.truncation)
        except (OSError, ValueError) as err:  # every such problem is in the files the user listed
            raise UserError(f"data.train_files: {err}") from None
        self.val_dataset = None
        if config.data.val_files:
            try:
                self.val_dataset = PromptDataset(config.data.val_files, self.tokenizer, config.data.max_prompt_length,
                                                 config.data.prompt_key, config.data.truncation)
            except (OSError, ValueError) as err:
                raise UserError(f"data.val_files: {err}") from None
        self.sampler = ResumableBatchSampler(len(self.dataset), config.data.batch_size, seed=config.data.seed)

        # The critic and the reference run in the actor's dtype, whatever their checkpoints were saved in.
        dtype = config.model.dtype
        packed = config.actor.use_packed_sequences
        # The log-probs of the update and of the KL term are the sampling distribution's (logits / temperature).
        temperature = sampling_temperature(config.rollout.temperature)
        replay = config.actor.router_replay
        self.actor = Actor(actor_ckpt, config.actor.optim, config.actor.loss, dtype=dtype,
                           schedule_steps=optimizer_steps(config, config.actor), packed_sequences=packed,
                           temperature=temperature, correction=config.algorithm.rollout_correction,
                           router_replay=replay, lora=config.actor.lora)
        self.reference = make_reference(actor_ckpt, use_kl=uses_reference(config), actor=self.actor, dtype=dtype,
                                        packed_sequences=packed, temperature=temperature, router_replay=replay)
        self.critic = None
        if self.uses_critic:
            self.critic_ckpt = Path(critic_ckpt or actor_ckpt)
            self.critic = Critic(self.critic_ckpt, config.critic.optim, config.critic.loss, dtype=dtype,
                                 packed_sequences=config.critic.use_packed_sequences,
                                 schedule_steps=optimizer_steps(config, config.critic), lora=config.critic.lora)
        self.reward = RuleReward(self.tokenizer, reward_fn or config.reward.function, config.reward.timeout_s,
                                 config.reward.memory_limit_mb)
        self.timeout_noted = False
        self.reward_model = HFRewardModel(config.reward.reward_model) if config.reward.reward_model else None

        rollout_dtype = DTYPES[resolve_rollout_dtype(config.rollout.engine, config.rollout.dtype, dtype)]
        self.hybrid = HybridEngine(self.actor.model, self.hf_config, self.family, config.parallel.rollout_tp,
                                   dtype=rollout_dtype)
        self.agent = self.make_agent_loop()
        # A multi-turn turn may ask for the longest budget left in its batch on top of a context of up to the
        # prompt and a whole budget: the engine's context limit holds both.
        responses = config.data.max_response_length * (2 if self.agent is not None else 1)
        self.remote = self.rollout = None
        if placement is not None and placement.disaggregated:
            self.remote = RemoteRollout(bridge, placement, self.hybrid, config.parallel.weight_push_bucket_mb,
                                        config.parallel.weight_push_verify)
        else:
            self.rollout = make_rollout_engine(config.rollout.engine, config.model.hf_path, self.hf_config.raw,
                                               self.hybrid.feed, max_model_len=config.data.max_prompt_length
                                               + responses, dtype=rollout_dtype,
                                               gpu_memory_utilization=config.rollout.gpu_memory_utilization)

        # An MoE model's rollout routing, where the engine can record it: replayed (actor.router_replay), and
        # compared with the trainer's own either way (actor/router_mismatch). The trajectory buffer of the other
        # rollout modes holds none.
        self.records_routing = (self.hf_config.num_experts is not None and self.rollout is not None
                                and self.rollout.records_routing and config.rollout.mode == "sync")
        if replay == "rollout" and not self.records_routing:
            raise UserError(f"actor.router_replay=rollout: the {type(self.rollout).__name__} rollout engine cannot "
                            "return the experts it routed each token to; set rollout.engine=embedded or "
                            "actor.router_replay=off")
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.reward_normalizer = RunningMeanStd()
        self.schedule = self.make_schedule()

    def make_schedule(self) -> Schedule:
        """rollout.mode's schedule; with async partial rollouts, the replicas' chunked generation (on the rollout
        ranks, or here) behind it."""
        config, rollout = self.config, self.config.rollout
        if rollout.mode != "async" or rollout.partial == "off":
            return RolloutSchedule(rollout.mode, rollout.max_staleness, config.data.batch_size, rollout.n,
                                   self.generation_round)
        layout = self.layout
        placement = rollout_placement(layout.rank, layout.world_size, layout.tp, config.parallel.rollout_tp)
        replicas = self.remote.replicas if self.remote is not None else placement.replicas
        params = [self.sampling_params(0, 0, replicas, replica) for replica in range(replicas)]
        chunk_tokens = rollout.partial_chunk_tokens
        if self.remote is not None:
            chunks = RemoteChunks(self.remote, params, chunk_tokens, rollout.partial, self.eos_token_ids)
        else:
            chunks = LocalChunks(self.rollout, params[placement.replica], chunk_tokens, rollout.partial,
                                 self.eos_token_ids, placement, layout.world_size)
        seeds = functools.partial(self.round_seeds, replicas)
        return PartialSchedule(rollout.max_staleness, config.data.batch_size, rollout.n, chunks, self.draw_round,
                               seeds)

    def draw_round(self) -> tuple[list[int], list[list[int]]]:
        """The next data.batch_size prompts of the sampler: their indices and token ids."""
        indices = list(self.sampler.next_batch())
        return indices, self.prompt_rows(indices)["input_ids"]

    def round_seeds(self, replicas: int, step: int, gen_round: int) -> list[int]:
        """Each replica's sampling seed of slot (step, gen_round), as a whole-round generation has it."""
        return [self.sampling_params(step, gen_round, replicas, replica).seed for replica in range(replicas)]

    def make_agent_loop(self) -> AgentLoop | None:
        """rollout.multi_turn's agent loop over its tools, or None for single-turn rollouts."""
        multi_turn, data = self.config.rollout.multi_turn, self.config.data
        if not multi_turn.enable:
            return None
        return AgentLoop(self.tokenizer, ToolSet(multi_turn.tools, self.config.tools), max_turns=multi_turn.max_turns,
                         budget=multi_turn.max_tokens or data.max_response_length, stop_token_ids=self.eos_token_ids,
                         tool_call_format=multi_turn.tool_call_format)

    @property
    def uses_critic(self) -> bool:
        return uses_critic(self.config)

    # --- checkpoints ----------------------------------------------------------------------------------

    def trainables(self) -> dict:
        trainables = {"actor": self.actor.trainable}
        if self.critic is not None:
            trainables["critic"] = self.critic.trainable
        return trainables

    def final_weights(self) -> list[tuple]:
        weights = [(self.actor.model, self.actor_ckpt, "actor")]
        if self.critic is not None:
            weights.append((self.critic.model, self.critic_ckpt, "critic"))
        return weights

    def job_state(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "reward_normalizer": self.reward_normalizer.state_dict(),
                "rollout_schedule": self.schedule.state_dict()}

    def load_job_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.reward_normalizer.load_state_dict(state["reward_normalizer"])
        if "rollout_schedule" in state:  # a checkpoint written before the schedule existed was sync's: no buffer
            self.schedule.load_state_dict(state["rollout_schedule"], len(self.dataset))

    # --- non-finite values --------------------------------------------------------------------------------

    def nonfinite_reward(self, scores: torch.Tensor) -> bool:
        """Whether the reward of some response is NaN/inf (see `_nonfinite`)."""
        source = "reward.model" if self.reward_model is not None else f"reward.function {self.reward.name!r}"
        return self._nonfinite({"the reward": scores}, f"{source} must return finite numbers")

    def nonfinite_batch(self, batch: dict) -> bool:
        """Whether the models' outputs or the advantages hold NaN/inf (see `_nonfinite`)."""
        computed = {name: batch[key] for key, name in COMPUTED_COLUMNS.items() if key in batch}
        return self._nonfinite(computed, "the model's outputs overflowed (lower the learning rates)")

    def _nonfinite(self, quantities: dict[str, torch.Tensor], hint: str) -> bool:
        """False if every quantity is finite. Otherwise counts a skip (trainer.nonfinite=skip) and returns
        True, or raises naming the first bad quantity, before anything of this step has been applied."""
        if all_finite(quantities.values()):
            return False
        bad = next((name, tensor) for name, tensor in quantities.items() if not torch.isfinite(tensor).all())
        return self._refuse_or_skip(f"{bad[0]} is NaN/inf ({_nonfinite_rows(bad[1])}); {hint}")

    def _refuse_or_skip(self, problem: str) -> bool:
        if self.config.trainer.nonfinite == "skip":
            self.nonfinite_skipped += 1
            self.logger.note(self.step + 1, f"skipped: {problem}")
            return True
        raise NonFiniteError(f"step {self.step + 1}: {problem}; stopped before applying it, nothing saved "
                             "(trainer.nonfinite=skip drops such batches instead)")

    def _update(self, role: str, update, *args) -> dict[str, float]:
        """A role's PPO update; non-finite gradients stop the run, or skip the rest of this update."""
        try:
            return {f"{role}/{key}": value for key, value in update(*args).items()}
        except NonFiniteError as err:
            self._refuse_or_skip(f"{role} {err} (lower {role}.optim.lr)")
            return {}

    def close(self) -> None:
        (self.rollout or self.remote).close()
        self.reward.close()
        if self.agent is not None:
            self.agent.toolset.close()

    def train_step(self) -> dict[str, float]:
        """One step: its batch from the rollout schedule, then the stages that learn from it; rounds generated
        meanwhile (rollout ranks of their own) come back (timed as rollout_wait) before the weights change."""
        timer = StageTimer()
        batch, rows, reward, sampling = self.sample_batch(timer)
        metrics = sampling if batch is None else self.learn(batch, rows, reward, sampling, timer)
        self.schedule.settle()
        if batch is None:
            return self.empty_step_metrics(metrics, timer)
        return self.step_metrics(metrics, batch, reward, timer)

    def learn(self, batch: dict, rows: dict, reward: RewardOutput, sampling: dict[str, float], timer: StageTimer
              ) -> dict[str, float]:
        """The stages after sampling, in dataflow order (a stage slots in here under its own name); a non-finite
        reward or model output ends them before anything is applied."""
        self.log_probs_and_values(batch, timer)
        self.log_samples(batch, rows, reward)
        if self.nonfinite_reward(reward.scores):
            return sampling
        metrics = {**sampling, **self.compute_advantages(batch, reward.scores, reward.token_level_rewards, rows["uid"],
                                                         rows.get("reward_baseline"))}
        if self.nonfinite_batch(batch):
            return metrics
        metrics.update(self.update_roles(self.without_overlong(batch), timer))
        metrics.update(self.rollout_mismatch(batch, rows))
        return metrics

    # --- stages ---------------------------------------------------------------------------------------

    def prompt_rows(self, indices: list[int]) -> dict:
        """The prompts `indices` of the dataset: their token ids, indices and the fields the reward reads."""
        items = [self.dataset[i] for i in indices]
        return {"input_ids": [item["input_ids"] for item in items], "index": list(indices),
                **{key: [item.get(key) for item in items] for key in PROMPT_FIELDS}}

    def sample_batch(self, timer: StageTimer) -> tuple[dict | None, dict, RewardOutput, dict[str, float]]:
        """The step's batch (None if no row is left), its rows, their reward and the sampling's metrics, from
        generation rounds. With dynamic sampling (algorithm.filter_groups) a round's groups whose filter metric
        is the same for every response are dropped, and rounds follow until data.batch_size groups are kept (cut
        to exactly that) or max_num_gen_batches rounds ran; then the run stops, or trains on the kept groups cut
        to whole mini-batches (on_exhausted). Without it: one round, every group kept. The rounds come from the
        rollout schedule (rollout.mode: generated now or earlier, see `trainer.rollout_schedule`); every round
        draws from the sampler, whose position a checkpoint saves with the schedule's buffer."""
        config, n = self.config, self.config.rollout.n
        filter_config = config.algorithm.filter_groups
        groups = GroupFilter(config.data.batch_size, n, filter_config.max_num_gen_batches if filter_config.enable
                             else 1, drop_constant=filter_config.enable)
        kept: list[tuple[dict, list, RewardOutput]] = []
        generated = []  # every response of the step's rounds, dropped ones too, for the metrics
        # One transition for all rounds: the weights do not change between them.
        with self.rollout_engine_awake(timer):
            self.schedule.fill(timer, self.step)
            while not groups.done:
                generation = self.schedule.take(self.step, groups.rounds, timer, self.step)
                rows, responses, reward, batch = self.scored_round(generation, timer)
                generated.append({"scores": reward.scores, "responses": batch["responses"],
                                  "response_tokens": response_tokens(batch),
                                  "timeouts": torch.tensor([row in reward.timeouts for row in range(len(responses))])})
                keep = groups.keep(self.filter_metric(reward)).repeat_interleave(n).nonzero().flatten().tolist()
                kept.append((take_rows(rows, keep), take_rows(responses, keep), reward.take(keep)))
            self.schedule.ahead(timer, self.step)
        rows, responses = (concat_rows(list(part)) for part in list(zip(*kept))[:2])
        reward = RewardOutput.concat([part[2] for part in kept])
        if groups.exhausted:
            usable = range(self.partial_batch_rows(groups))
            rows, responses, reward = take_rows(rows, usable), take_rows(responses, usable), reward.take(usable)
        rows["uid"] = [row // n for row in range(len(responses))]  # a group per prompt drawn, even drawn twice
        generated = concat_rows(generated)
        metrics = self.overlong_metrics(generated)
        if filter_config.enable:
            metrics.update(groups.metrics())
            metrics["filter_groups/generated_score_mean"] = generated["scores"].mean().item()
        if self.reward.worker is not None:  # every answer the worker stopped, in dropped groups too
            metrics["reward/timeouts"] = int(generated["timeouts"].sum())
        if self.agent is not None:  # the episodes trained on
            metrics.update(episode_metrics(rows["episode"]))
        batch = self.rollout_batch(rows, responses) if responses else None
        if batch is not None and ROLLOUT_VERSIONS in batch:  # how many optimizer steps the weights that sampled lag
            metrics.update(staleness_metrics(batch[ROLLOUT_VERSIONS], self.step, batch["response_mask"]))
        return batch, rows, reward, metrics

    def generation_round(self, timer: StageTimer, step: int, gen_round: int) -> Pending:
        """data.batch_size prompts drawn and their responses (with ReMax's greedy ones where the estimator takes
        them) from the current weights, seeded by slot (step, gen_round). Runs in the rollout engine's awake
        window. With rollout ranks of their own, a request they answer while the step goes on."""
        indices = list(self.sampler.next_batch())
        prompts = self.prompt_rows(indices)
        if self.remote is not None:
            replicas = self.remote.replicas
            params = [self.sampling_params(step, gen_round, replicas, replica) for replica in range(replicas)]
            pending = self.remote.request(prompts["input_ids"], params)
            return Pending(lambda: self.answered_round(indices, pending, timer))
        with timer("rollout"):
            responses = self.generate(prompts["input_ids"], step=step, gen_round=gen_round,
                                      conversations=prompts["raw_prompt"])
        greedy = None
        if self.uses_greedy_baseline:
            params = SamplingParams(temperature=0.0, max_new_tokens=self.config.data.max_response_length)
            with timer("remax_baseline"):
                greedy = self.generate(prompts["input_ids"], params, conversations=prompts["raw_prompt"])
        return Pending.done(GeneratedRound(indices, responses, greedy))

    @staticmethod
    def answered_round(indices: list[int], pending: Pending, timer: StageTimer) -> GeneratedRound:
        """The rollout ranks' round once they answer: the training ranks' wait is `rollout_wait`, the rollout
        ranks' work for it `rollout_ranks_busy` and `rollout_ranks_cpu` (the bench's idle shares of both sides)."""
        with timer("rollout_wait"):
            responses, busy = pending.result()
        busy.count_into(timer)
        return GeneratedRound(indices, responses)

    def scored_round(self, generation: GeneratedRound, timer: StageTimer
                     ) -> tuple[dict, list[Response], RewardOutput, dict]:
        """A generated round's rows (with ReMax's greedy baseline where the estimator takes it), responses,
        reward (overlong penalty included) and batch."""
        prompts, responses = self.prompt_rows(generation.indices), generation.responses
        rows = with_episodes(one_row_per_response(prompts, self.config.rollout.n), responses)
        if generation.greedy is not None:
            rows["reward_baseline"] = self.remax_baselines(prompts, generation.greedy, timer)
        batch = self.rollout_batch(rows, responses)
        with timer("reward"):
            return rows, responses, self.shape_overlong(batch, self.agreed_score(batch, rows)), batch

    def rollout_batch(self, rows: dict, responses: list[Response], log_probs: bool = True) -> dict:
        """The batch of `rows`' prompts and their responses (with the engine's log-probs, multi-turn episodes'
        loss masks, and the routing where the engine recorded it)."""
        return build_rollout_batch(rows["input_ids"], [r.token_ids for r in responses],
                                   self.config.data.max_response_length, self.tokenizer.pad_token_id,
                                   [r.logprobs for r in responses] if log_probs else None,
                                   [r.loss_mask for r in responses], rollout_routing(responses),
                                   [r.token_versions for r in responses])

    @property
    def uses_greedy_baseline(self) -> bool:
        return "reward_baselines" in estimator_inputs(self.config.algorithm.adv_estimator)

    def remax_baselines(self, prompts: dict, greedy: list[Response], timer: StageTimer) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy response per prompt (generated by the same engine and
        weights as the samples, in their round), scored like them, repeated for the prompt's n rows [B]; timed as
        `remax_baseline`."""
        with timer("remax_baseline"):
            rows = with_episodes({key: prompts[key] for key in ("input_ids", *PROMPT_FIELDS)}, greedy)
            scores = self.agreed_score(self.rollout_batch(rows, greedy, log_probs=False), rows).scores
        return scores.repeat_interleave(self.config.rollout.n)

    def agreed_score(self, batch: dict, rows: dict) -> RewardOutput:
        """Collective: `score`, rank 0's on every rank. Every rank scores the whole batch, and a reward under a time
        limit (or any that is not deterministic) can differ between ranks; the batch they filter and train on
        must not."""
        reward = self.score(batch, rows)
        if self.layout.world_size > 1:
            shared = [reward]
            dist.broadcast_object_list(shared, src=0)
            reward = shared[0]
        return reward

    def filter_metric(self, reward: RewardOutput) -> torch.Tensor:
        """[B] what dynamic sampling compares within a group: the score, or a dict reward's extra field."""
        metric = self.config.algorithm.filter_groups.metric
        if metric == "score":
            return reward.scores
        if metric not in reward.extras:
            raise UserError(f"algorithm.filter_groups.metric={metric!r}: the reward returns no such field (its "
                            f"fields: score{''.join(', ' + name for name in reward.extras)})")
        return torch.as_tensor(reward.extras[metric], dtype=torch.float64)

    def partial_batch_rows(self, groups: GroupFilter) -> int:
        """Dynamic sampling out of rounds: stop (on_exhausted=stop), or the rows of the kept groups that fill whole
        actor (and critic) mini-batches, so they still split over the data-parallel ranks and micro-batches."""
        config = self.config
        filter_config = config.algorithm.filter_groups
        sizes = [config.actor.mini_batch_size] + ([config.critic.mini_batch_size] if self.critic is not None else [])
        shortfall = (f"dynamic sampling kept {groups.kept} of data.batch_size={config.data.batch_size} groups in "
                     f"algorithm.filter_groups.max_num_gen_batches={filter_config.max_num_gen_batches} rounds")
        try:
            usable = trainable_groups(groups, filter_config.on_exhausted, sizes)
        except BatchNotFilled:
            raise UserError(f"step {self.step + 1}: {shortfall}: too many prompts were answered all alike; raise it, "
                            "set it to 0 for no bound, or set algorithm.filter_groups.on_exhausted=train") from None
        self.logger.note(self.step + 1, f"{shortfall}; training on {usable} of them (whole mini-batches)")
        return usable * config.rollout.n

    def shape_overlong(self, batch: dict, reward: RewardOutput) -> RewardOutput:
        """reward.overlong_buffer: DAPO's soft overlong punishment added to the scores (and to the token-level
        rewards at each response's last token)."""
        buffer = self.config.reward.overlong_buffer
        if not buffer.enable:
            return reward
        penalty = overlong_penalty(response_tokens(batch).sum(dim=-1), self.config.data.max_response_length,
                                   buffer.len, buffer.penalty_factor)
        return reward._replace(scores=reward.scores + penalty, token_level_rewards=reward.token_level_rewards
                               + scores_to_token_rewards(penalty, batch["response_mask"]))

    def without_overlong(self, batch: dict) -> dict:
        """algorithm.overlong_filtering: the batch the losses see, truncated responses masked out."""
        if not self.config.algorithm.overlong_filtering:
            return batch
        return {**batch, "response_mask": batch["response_mask"] * overlong_filtered_mask(
            batch["responses"], response_tokens(batch), self.eos_token_ids)}

    def overlong_metrics(self, generated: dict) -> dict[str, float]:
        """The share of truncated responses and their mean overlong penalty, where either feature is on, from
        the generated `responses` and their `response_tokens` (every response token)."""
        buffer, mask = self.config.reward.overlong_buffer, generated["response_tokens"]
        if not (buffer.enable or self.config.algorithm.overlong_filtering):
            return {}
        truncated = truncated_responses(generated["responses"], mask, self.eos_token_ids)
        metrics = {"dapo/overlong_fraction": truncated.float().mean().item()}
        if buffer.enable:
            metrics["dapo/overlong_penalty_mean"] = overlong_penalty(
                mask.sum(dim=-1), self.config.data.max_response_length, buffer.len, buffer.penalty_factor
            ).mean().item()
        return metrics

    @property
    def eos_token_ids(self) -> list[int]:
        """The tokens a response stops at: the model config's EOS ids (the engines stop there) and the
        tokenizer's."""
        eos = self.hf_config.raw.get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        return sorted(set(ids) | ({self.tokenizer.eos_token_id} - {None}))

    def empty_step_metrics(self, sampling: dict[str, float], timer: StageTimer) -> dict[str, float]:
        """A step whose dynamic sampling kept less than one mini-batch: nothing trained, the sampling logged."""
        self.logger.note(self.step + 1, "no group to train on: this step updates nothing")
        return {**sampling, "trainer/nonfinite_skipped": self.nonfinite_skipped, **step_performance(timer, 0)}

    @contextlib.contextmanager
    def rollout_engine_awake(self, timer: StageTimer):
        """The rollout engine with the actor's current weights and its KV cache, for the body; the training side's
        memory (gradient buffers, optimizer state, allocator cache) is released before the engine wakes, so the
        KV cache is not allocated on top of it, and comes back after the engine sleeps."""
        if self.remote is not None:  # the rollout ranks' engines: the current weights pushed to them
            if self.remote.version != self.step:
                with timer("transition"):
                    self.remote.push(self.step)
            yield
            return
        with training_memory_released(self.actor.model, self.actor.trainable.optimizer):
            with timer("transition"):
                self.sync_rollout_weights()
            yield
            with timer("transition"):
                self.rollout.sleep()

    def sync_rollout_weights(self) -> None:
        """The HybridEngine transition: the actor's current weights into the rollout engine, KV cache ready."""
        self.rollout.wake_up(["weights"])
        self.rollout.load_weights(self.hybrid.stream())
        self.rollout.wake_up(["kv_cache"])

    def log_probs_and_values(self, batch: dict, timer: StageTimer) -> None:
        """Add what the models say of the responses: the old log-probs (where the update needs a separate pass),
        the reference's log-probs and the critic's values, where the config uses them."""
        actor, critic = self.config.actor, self.config.critic
        micro, actor_tokens = actor.micro_batch_size, actor.max_tokens_per_micro_batch
        if self.needs_old_log_probs(len(batch["responses"])):
            # The optimal token baseline's sum_v pi_v^2 comes from the same forward as the old log-probs.
            sum_pi_squared = "sum_pi_squared" in estimator_inputs(self.config.algorithm.adv_estimator)
            with timer("old_log_prob"):
                old = self.actor.compute_log_prob(batch, micro, max_tokens=actor_tokens,
                                                  return_sum_pi_squared=sum_pi_squared)
            batch.update({"old_log_probs" if key == "log_probs" else key: value.cpu() for key, value in old.items()})
        if self.reference is not None:
            with timer("ref_log_prob"):
                batch["ref_log_probs"] = self.reference.compute_ref_log_prob(batch, micro, actor_tokens).cpu()
        if self.critic is not None:
            with timer("values"):
                batch["values"] = self.critic.compute_values(batch, critic.micro_batch_size,
                                                             critic.max_tokens_per_micro_batch).cpu()

    def log_samples(self, batch: dict, rows: dict, reward: RewardOutput) -> None:
        """Every `trainer.log_samples_every` steps, rank 0 appends some of the step's samples to generations.jsonl."""
        every = self.config.trainer.log_samples_every
        if every > 0 and (self.step + 1) % every == 0 and self.layout.rank == 0:
            self.logger.log_samples(self.step + 1, self.sample_rows(batch, rows, reward))

    def update_roles(self, batch: dict, timer: StageTimer) -> dict[str, float]:
        """The critic's update (with one), then the actor's."""
        actor, critic = self.config.actor, self.config.critic
        metrics = {}
        if self.critic is not None:
            with timer("update_critic"):
                metrics.update(self._update("critic", self.critic.update_critic, batch, critic.ppo_epochs,
                                            critic.mini_batch_size, critic.micro_batch_size,
                                            critic.max_tokens_per_micro_batch))
        with timer("update_actor"):
            metrics.update(self._update("actor", self.actor.update_policy, batch, actor.ppo_epochs,
                                        actor.mini_batch_size, actor.micro_batch_size,
                                        actor.max_tokens_per_micro_batch))
        return metrics

    def needs_old_log_probs(self, rows: int) -> bool:
        """A separate old-log-prob pass is redundant when the update is on-policy (the actor then takes them from
        its first forward, bitwise the same) or its loss takes the rollout's log-probs as the old ones (bypass
        mode), unless the KL penalty in the reward or the estimator needs them before the update."""
        actor = self.config.actor
        kl_in_reward = self.reference is not None and self.config.algorithm.use_kl_in_reward
        estimator_needs = "old_log_probs" in estimator_inputs(self.config.algorithm.adv_estimator)
        update_needs = not (old_log_probs_from_rollout(actor.loss.policy_loss)
                            or is_on_policy(actor.ppo_epochs, actor.mini_batch_size, rows))
        return kl_in_reward or estimator_needs or update_needs

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, step: int = 0,
                 gen_round: int = 0, conversations: list | None = None) -> list[Response]:
        """Each rollout replica generates its share of the prompts; every rank gets all responses, each with its
        tokens' log-probs under the distribution they were sampled from (the engine's own, at no extra pass).
        `params`: the rollout's sampling (rollout.*, n per prompt, seeded by the slot (`step`, `gen_round`)) unless
        given. `conversations`: the prompts as the data gives them, which multi-turn
        episodes start from (rendered with the tools' schemas)."""
        config, layout = self.config, self.layout
        placement = rollout_placement(layout.rank, layout.world_size, layout.tp, config.parallel.rollout_tp)
        replicas, replica = placement.replicas, placement.replica
        share = len(prompts) // replicas
        mine = prompts[replica * share:(replica + 1) * share]
        params = params or self.sampling_params(step, gen_round, replicas, replica)
        mine_conversations = None if conversations is None else conversations[replica * share:(replica + 1) * share]
        responses = [dataclasses.replace(r, prompt_index=replica * share + r.prompt_index)
                     for r in self.rollout_responses(mine, mine_conversations, params)] if mine else []
        gathered: list = [None] * layout.world_size
        dist.all_gather_object(gathered, (replica, placement.leads_replica, responses))
        by_replica = {rep: resp for rep, is_leader, resp in gathered if is_leader}
        return [response for rep in range(replicas) for response in by_replica[rep]]

    def sampling_params(self, step: int, gen_round: int, replicas: int, replica: int) -> SamplingParams:
        """The rollout's sampling (rollout.*, n per prompt) for a replica, seeded by the slot (step, gen_round)."""
        rollout = self.config.rollout
        return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                              max_new_tokens=self.config.data.max_response_length, n=rollout.n, logprobs=True,
                              routed_experts=self.records_routing,
                              seed=rollout_seed(rollout.seed, step, gen_round, replicas, replica))

    def rollout_responses(self, prompts: list[list[int]], conversations: list | None, params: SamplingParams
                          ) -> list[Response]:
        """This replica's responses: multi-turn episodes through the agent loop where it runs (from the
        conversations), else the engine's single turns."""
        if self.agent is None:
            return self.rollout.generate(prompts, params)
        return self.agent.run(self.rollout, [as_messages(prompt) for prompt in conversations], params)

    def rollout_mismatch(self, batch: dict, rows: dict) -> dict[str, float]:
        """`rollout_corr/<metric>` (and `rollout_corr/<metric>/<data_source>`, where rows have one): how far the
        rollout engine's log-probs are from the trainer's on the step's responses, and what the configured
        correction truncated or masked (see `algorithms.mismatch_metrics`). The trainer's are the old-log-prob
        pass's where it ran, else the on-policy update's first forward's (the same numbers: the weights that
        generated the batch), which are the ones the correction used."""
        train = batch.get("old_log_probs", self.actor.first_forward_log_probs)
        if "rollout_log_probs" not in batch or train is None:
            return {}
        rollout, mask = batch["rollout_log_probs"], batch["response_mask"]
        config = self.config.algorithm.rollout_correction
        correction = rollout_correction(train, rollout, mask, weights=config.weights, weight_cap=config.weight_cap,
                                        reject=config.reject, reject_low=config.reject_low,
                                        reject_high=config.reject_high)
        sources = [None if source is None else str(source) for source in rows["data_source"]]
        return {f"rollout_corr/{name}": value
                for name, value in mismatch_metrics_by_source(train, rollout, mask, correction, sources).items()}

    def sample_rows(self, batch: dict, rows: dict, reward: RewardOutput) -> list[dict]:
        """`trainer.log_samples` rows of the step for generations.jsonl: the first sample of as many prompts as
        there are, then their second samples, ...; the prompt as the data file gives it, the response (all of a
        multi-turn episode's tokens, and its messages) with special tokens dropped, and a dict reward's extra
        fields."""
        scores = reward.scores
        n, total = self.config.rollout.n, len(scores)
        chosen = sorted(range(total), key=lambda row: (row % n, row))[:self.config.trainer.log_samples]
        responses = self.reward.decode(batch["responses"][chosen], response_tokens(batch)[chosen])
        samples = [{"prompt": prompt_text(rows["raw_prompt"][row]), "response": response, "score": scores[row].item()}
                   for row, response in zip(chosen, responses)]
        for row, sample in zip(chosen, samples):
            if rows["data_source"][row] is not None:
                sample["data_source"] = str(rows["data_source"][row])
            sample.update(row_fields(reward, row))
            if "episode" in rows:
                sample["messages"] = rows["episode"][row].messages
        return samples

    def validate(self) -> dict[str, float]:
        """The mean reward of greedy generations on data.val_files, overall and per data_source, and their mean
        length. Each rollout replica generates and scores its share (every replicas-th prompt, in batches of
        data.batch_size); the sums are gathered from every replica's leader. With rollout ranks of their own, they
        generate every batch (split over their replicas) and the first training rank scores it."""
        if self.val_dataset is None:
            return {}
        config, layout = self.config, self.layout
        if self.remote is not None:
            mine, leads = [self.val_dataset[i] for i in range(len(self.val_dataset))], layout.rank == 0
        else:
            placement = rollout_placement(layout.rank, layout.world_size, layout.tp, config.parallel.rollout_tp)
            mine = [self.val_dataset[i] for i in range(placement.replica, len(self.val_dataset), placement.replicas)]
            leads = placement.leads_replica
        greedy = SamplingParams(temperature=0.0, max_new_tokens=config.data.max_response_length,
                                seed=config.rollout.seed)
        sums: dict[str | None, list[float]] = {}  # data_source -> [reward sum, rows, response tokens, timeouts]
        field_sums: dict[str, list[float]] = {}  # a dict reward's numeric field -> [sum, rows with it]
        with self.rollout_engine_awake(StageTimer()):
            for start in range(0, len(mine), config.data.batch_size):
                items = mine[start:start + config.data.batch_size]
                rows = {key: [item.get(key) for item in items] for key in ("input_ids", *PROMPT_FIELDS)}
                responses = self.validation_responses(rows, greedy)
                if not leads:  # its replica's leader scores the same responses
                    continue
                rows = with_episodes(rows, responses)
                batch = self.rollout_batch(rows, responses, log_probs=False)
                reward = self.score(batch, rows)
                lengths = response_tokens(batch).sum(dim=-1)
                for row, (source, score, length) in enumerate(zip(rows["data_source"], reward.scores.tolist(),
                                                                   lengths.tolist())):
                    entry = sums.setdefault(None if source is None else str(source), [0.0, 0, 0, 0])
                    entry[0], entry[1], entry[2] = entry[0] + score, entry[1] + 1, entry[2] + length
                    entry[3] += row in reward.timeouts
                add_field_sums(field_sums, reward.extras)
        totals = _sum_over_ranks(sums, layout.world_size)
        reward_sum, count, tokens, timeouts = (sum(values[i] for values in totals.values()) for i in range(4))
        metrics = {"reward_mean": reward_sum / count, "response_length_mean": tokens / count}
        for source in sorted(name for name in totals if name is not None):
            metrics[f"reward_mean/{source}"] = totals[source][0] / totals[source][1]
        for name, (total, rows_with_it) in sorted(_sum_over_ranks(field_sums, layout.world_size).items()):
            metrics[f"reward/{name}"] = total / rows_with_it if rows_with_it else float("nan")
        if self.reward.worker is not None:
            metrics["reward/timeouts"] = timeouts
        return metrics

    def validation_responses(self, rows: dict, greedy: SamplingParams) -> list[Response]:
        """This replica's greedy responses to a validation batch, or every one from the rollout ranks."""
        if self.remote is None:
            return self.rollout_responses(rows["input_ids"], rows["raw_prompt"], greedy)
        responses, _ = self.remote.request(rows["input_ids"], [greedy] * self.remote.replicas).result()
        return responses

    def score(self, batch: dict, rows: dict) -> RewardOutput:
        """Sequence scores [B], the same placed on each response's last token [B, R], and a dict reward's extra
        fields (none for a reward model)."""
        if self.reward_model is not None:
            texts = self.reward.decode(batch["responses"], batch["response_mask"])
            scores = self.reward_model.score(rows["raw_prompt"], texts).float().cpu()
            return RewardOutput(scores, scores_to_token_rewards(scores, batch["response_mask"]))
        truths = [(info or {}).get("ground_truth") for info in rows["reward_model"]]
        extra_infos, episodes = rows.get("extra_info"), rows.get("episode")
        if episodes is not None:  # the reward sees the whole episode; its answer is the last assistant turn
            extra_infos = [episode_fields(episode, info) for episode, info in zip(episodes, extra_infos)]
        reward = self.reward(batch["responses"], batch["response_mask"], truths, rows["data_source"], extra_infos,
                             episodes=episodes)
        self.note_first_timeout(reward, rows)
        return reward

    def note_first_timeout(self, reward: RewardOutput, rows: dict) -> None:
        """The run's first answer stopped by the scoring worker's limits goes to the log; later ones are only
        counted (reward/timeouts), so a policy that learns to emit them does not flood it."""
        if not reward.timeouts or self.timeout_noted:
            return
        row, reason = next(iter(reward.timeouts.items()))
        self.logger.note(self.step + 1, f"reward.function {self.reward.name!r} on response {row} (data_source "
                                        f"{rows['data_source'][row]!r}) {reason}: scored 0, its worker replaced; "
                                        "later ones are counted in reward/timeouts, not logged")
        self.timeout_noted = True

    def compute_advantages(self, batch: dict, scores: torch.Tensor, token_scores: torch.Tensor, uids: list[int],
                           reward_baselines: torch.Tensor | None = None) -> dict[str, float]:
        """batch['advantages'] and batch['returns'] from the configured estimator, given the inputs it names
        (see algorithms.advantages) and its knobs from `algorithm.*`; the KL in the reward applied first."""
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

    def step_metrics(self, metrics: dict, batch: dict, reward: RewardOutput, timer: StageTimer
                     ) -> dict[str, float]:
        """The step's `metrics` with its rewards (and a dict reward's fields), response lengths, skip count and
        performance."""
        lengths = response_tokens(batch).sum(dim=-1).float()
        scores = reward.scores
        # reward/timeouts is the sampling's: it counts the answers of dropped groups too.
        fields = {f"reward/{name}": values.nanmean().item() for name, values in reward.extras.items()}
        return {**metrics, **fields, "trainer/nonfinite_skipped": self.nonfinite_skipped,
                "reward/mean": scores.mean().item(), "reward/std": scores.std().item() if len(scores) > 1 else 0.0,
                "response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item(),
                **self.weight_push_metrics(), **step_performance(timer, batch["attention_mask"].sum().item())}

    def weight_push_metrics(self) -> dict[str, int]:
        """With parallel.weight_push_verify: how many tensors of the last push to the rollout ranks had the same
        checksum on both sides (every one, or the push would have stopped the run)."""
        if self.remote is None or not self.remote.verify:
            return {}
        return {"weight_push/verified_tensors": self.remote.verified_tensors}


def with_episodes(rows: dict, responses: list[Response]) -> dict:
    """Multi-turn rows: each row's episode, and its prompt as the episode rendered it (with the tools' schemas);
    single-turn rows as they are."""
    if not responses or responses[0].episode is None:
        return rows
    episodes: list[EpisodeInfo] = [response.episode for response in responses]
    return {**rows, "input_ids": [episode.prompt_ids for episode in episodes], "episode": episodes}


def add_field_sums(sums: dict[str, list[float]], extras: dict[str, torch.Tensor]) -> None:
    """Add each field's sum and count of rows that have it (not NaN) to `sums`."""
    for name, values in extras.items():
        present = ~torch.isnan(values)
        entry = sums.setdefault(name, [0.0, 0])
        entry[0], entry[1] = entry[0] + values[present].sum().item(), entry[1] + int(present.sum())


def row_fields(reward: RewardOutput, row: int) -> dict:
    """One response's extra fields for its logged sample: the numeric ones it has, then the others."""
    numeric = {name: values[row].item() for name, values in reward.extras.items() if not values[row].isnan()}
    return {**numeric, **reward.sample_fields[row]} if reward.sample_fields else numeric


def rollout_routing(responses: list[Response]) -> list[torch.Tensor] | None:
    """The responses' routed experts, where the engine recorded them (see `Response.routed_experts`)."""
    routes = [response.routed_experts for response in responses]
    return None if any(route is None for route in routes) else routes


def take_rows(rows, index):
    """The rows `index` of per-row values: a tensor's, a list's, or each of a dict's values."""
    if isinstance(rows, torch.Tensor):
        return rows[torch.as_tensor(list(index), dtype=torch.long)]
    if isinstance(rows, dict):
        return {key: take_rows(values, index) for key, values in rows.items()}
    if isinstance(rows, list):
        return [rows[i] for i in index]
    raise TypeError(f"{type(rows).__name__} is not a per-row value")


def concat_rows(parts: list):
    """Per-row values of several parts (tensors, lists, or dicts of them) one after the other."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return {key: concat_rows([part[key] for part in parts]) for key in first}
    if isinstance(first, list):
        return [row for part in parts for row in part]
    raise TypeError(f"{type(first).__name__} is not a per-row value")


def _sum_over_ranks(sums: dict, world_size: int) -> dict:
    """Collective: every rank's {key: [numbers]} added up key by key and position by position."""
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, sums)
    totals: dict = {}
    for rank_sums in gathered:
        for key, values in rank_sums.items():
            totals[key] = [a + b for a, b in zip(totals.get(key, [0] * len(values)), values)]
    return totals


def prompt_text(prompt: str | list[dict]) -> str:
    """A data row's prompt as one string: chat messages one per line, "role: content"."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{message['role']}: {message['content']}" for message in prompt)


def _nonfinite_rows(values: torch.Tensor) -> str:
    """Which rows of `values` hold NaN/inf, for the error message."""
    rows = (~torch.isfinite(values)).reshape(len(values), -1).any(dim=-1).nonzero().flatten().tolist()
    if not rows:
        return "on another rank"
    first = values[rows[0]].flatten()
    return f"{len(rows)} of {len(values)} rows, first row {rows[0]}: {first[~torch.isfinite(first)][0].item()}"


def optimizer_steps(config: TrainConfig, role) -> int:
    """Optimizer steps a role takes over the run: the LR schedule's length (it steps once per mini-batch)."""
    sequences = config.data.batch_size * config.rollout.n
    return config.trainer.total_steps * role.ppo_epochs * (sequences // role.mini_batch_size)
