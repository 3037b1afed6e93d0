"""The first stage of the RL step: the batch it trains on, from generation rounds, scored.

A round is data.batch_size prompts drawn from the sampler and their rollout.n responses each (with ReMax's
greedy one per prompt where the estimator takes it). The rounds come from the rollout schedule (`rollout.mode`:
generated now or earlier, `trainer.rl.schedule`); every round draws from the sampler, whose position a
checkpoint saves with the schedule's buffer. With dynamic sampling (algorithm.filter_groups) a round's groups
whose filter metric is the same for every response are dropped, and rounds follow until data.batch_size groups
are kept (cut to exactly that) or max_num_gen_batches rounds ran; then the run stops, or trains on the kept
groups cut to whole mini-batches (on_exhausted). Without it: one round, every group kept.
"""
from __future__ import annotations

import functools

import torch

from verl_mega.algorithms import BatchNotFilled, GroupFilter, trainable_groups
from verl_mega.algorithms.staleness import staleness_metrics
from verl_mega.config import TrainConfig
from verl_mega.config.errors import UserError
from verl_mega.data.prompts import PromptDataset
from verl_mega.data.sampler import ResumableBatchSampler
from verl_mega.files.plain_state import entry
from verl_mega.rollout.agent_loop import episode_metrics
from verl_mega.rollout.engine import Response, SamplingParams
from verl_mega.rollout.trajectory_buffer import RunBounds
from verl_mega.roles.reward import RewardOutput

from ..metrics import StageTimer
from ..rollout_batch import ROLLOUT_VERSIONS, response_tokens
from .generation import Generation
from .needs import uses_critic, uses_greedy_baseline
from .partial_schedule import LocalChunks, PartialSchedule
from .remote import RemoteChunks
from .rows import PROMPT_FIELDS, concat_rows, one_row_per_response, prompt_rows, responses_batch, take_rows, \
    with_episodes
from .schedule import GeneratedRound, Pending, RolloutSchedule, Schedule
from .scoring import Scoring
from .step import Note, Step


class Sampling:
    """Fills a step's batch, rows, reward and sampling metrics, or ends it when no group is left to train on.
    Stateful: the sampler's position (`sampler`) and the schedule's buffer (`rollout_schedule`)."""

    def __init__(self, config: TrainConfig, dataset: PromptDataset, generation: Generation, scoring: Scoring,
                 pad_token_id: int, note: Note, vocab_size: int):
        """`vocab_size`: the model's (its config's), which the token ids of a saved state must stay below."""
        self.config, self.dataset, self.generation, self.scoring = config, dataset, generation, scoring
        self.pad_token_id, self.note, self.vocab_size = pad_token_id, note, vocab_size
        self.sampler = ResumableBatchSampler(len(dataset), config.data.batch_size, seed=config.data.seed)
        self.schedule = self.make_schedule()

    def make_schedule(self) -> Schedule:
        """rollout.mode's schedule; with async partial rollouts, the replicas' chunked generation (on the rollout
        ranks, or here) behind it."""
        config, rollout, generation = self.config, self.config.rollout, self.generation
        if rollout.mode != "async" or rollout.partial == "off":
            return RolloutSchedule(rollout.mode, rollout.max_staleness, config.data.batch_size, rollout.n,
                                   self.generation_round)
        replicas = generation.replicas
        params = [generation.sampling_params(0, 0, replicas, replica) for replica in range(replicas)]
        chunk_tokens, eos_ids = rollout.partial_chunk_tokens, generation.eos_token_ids
        if generation.remote is not None:
            chunks = RemoteChunks(generation.remote, params, chunk_tokens, rollout.partial, eos_ids)
        else:
            coordinates = generation.rollout_coordinates()
            chunks = LocalChunks(generation.engine, params[coordinates.replica], chunk_tokens, rollout.partial,
                                 eos_ids, coordinates, generation.layout.world_size)
        seeds = functools.partial(generation.round_seeds, replicas)
        return PartialSchedule(rollout.max_staleness, config.data.batch_size, rollout.n, chunks, self.draw_round,
                               seeds)

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "rollout_schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The sampler's position and the schedule's buffer from a job state (trainer_state.json's keys, its
        `step` among them), every value checked before any is taken: a bad one is a ValueError naming its key."""
        self.sampler.check_state_dict(entry(state, "sampler", dict, ""))
        if "rollout_schedule" in state:
            self.schedule.load_state_dict(entry(state, "rollout_schedule", dict, ""),
                                          self.state_bounds(state["step"]))
        elif self.config.rollout.mode != "sync":
            # Only a checkpoint written before the schedule existed lacks it, and that run was sync: resumed here,
            # the prompts and responses it held in flight would be lost without a word.
            raise ValueError(f"it has no 'rollout_schedule', which this run (rollout.mode="
                             f"{self.config.rollout.mode}) resumes its prompts and responses in flight from")
        self.sampler.load_state_dict(state["sampler"])

    def state_bounds(self, step: int) -> RunBounds:
        """What a saved schedule may hold in this run, checkpointed after `step` steps."""
        data = self.config.data
        return RunBounds(prompts=len(self.dataset), vocab_size=self.vocab_size,
                         max_prompt_tokens=data.max_prompt_length, max_response_tokens=data.max_response_length,
                         newest_version=step)

    def run(self, step: Step) -> None:
        config, n, timer = self.config, self.config.rollout.n, step.timer
        filter_config = config.algorithm.filter_groups
        groups = GroupFilter(config.data.batch_size, n, filter_config.max_num_gen_batches if filter_config.enable
                             else 1, drop_constant=filter_config.enable)
        kept: list[tuple[dict, list, RewardOutput]] = []
        generated = []  # every response of the step's rounds, dropped ones too, for the metrics
        if self.generation.endpoint is not None:  # validation's sessions since the last step: their lines only
            self.generation.endpoint.drain(self.note, step.number)
        # One transition for all rounds: the weights do not change between them.
        with self.generation.awake(timer, step.index):
            self.schedule.fill(timer, step.index)
            while not groups.done:
                rows, responses, reward, batch = self.scored_round(
                    self.schedule.take(step.index, groups.rounds, timer, step.index), step)
                generated.append({"scores": reward.scores, "responses": batch["responses"],
                                  "response_tokens": response_tokens(batch),
                                  "timeouts": torch.tensor([row in reward.timeouts for row in range(len(responses))]),
                                  "worker_deaths": torch.tensor([row in reward.worker_deaths
                                                                 for row in range(len(responses))])})
                keep = groups.keep(self.filter_metric(reward)).repeat_interleave(n).nonzero().flatten().tolist()
                kept.append((take_rows(rows, keep), take_rows(responses, keep), reward.take(keep)))
            self.schedule.ahead(timer, step.index)
        rows, responses = (concat_rows(list(part)) for part in list(zip(*kept))[:2])
        reward = RewardOutput.concat([part[2] for part in kept])
        if groups.exhausted:
            usable = range(self.partial_batch_rows(groups, step.number))
            rows, responses, reward = take_rows(rows, usable), take_rows(responses, usable), reward.take(usable)
        rows["uid"] = [row // n for row in range(len(responses))]  # a group per prompt drawn, even drawn twice
        step.rows, step.reward = rows, reward
        step.metrics.update(self.sampling_metrics(concat_rows(generated), rows, groups))
        if self.generation.endpoint is not None:  # this replica's sessions, and the lines of its dropped samples
            step.metrics.update(self.generation.endpoint.drain(self.note, step.number))
        if not responses:
            self.note(step.number, "no group to train on: this step updates nothing")
            step.ended = True
            return
        step.batch = self.batch(rows, responses)
        if ROLLOUT_VERSIONS in step.batch:  # how many optimizer steps the weights that sampled it lag
            step.metrics.update(staleness_metrics(step.batch[ROLLOUT_VERSIONS], step.index,
                                                  step.batch["response_mask"]))

    def sampling_metrics(self, generated: dict, rows: dict, groups: GroupFilter) -> dict[str, float]:
        """Overlong shares, dynamic sampling's counts and scores, the worker's timeouts and deaths (over every
        generated response, dropped ones too), the scoring service's latency, retries and failures, and the agent's
        episodes (trained on)."""
        metrics = self.scoring.overlong_metrics(generated, self.generation.eos_token_ids)
        if self.config.algorithm.filter_groups.enable:
            metrics.update(groups.metrics())
            metrics["filter_groups/generated_score_mean"] = generated["scores"].mean().item()
        if self.scoring.counts_timeouts:
            metrics["reward/timeouts"] = int(generated["timeouts"].sum())
            metrics["reward/worker_deaths"] = int(generated["worker_deaths"].sum())
        if self.scoring.remote is not None:  # every request of the step's rounds and baselines
            metrics.update(self.scoring.remote_stats().metrics())
        if "episode" in rows:
            metrics.update(episode_metrics(rows["episode"]))
        return metrics

    def draw_round(self) -> tuple[list[int], list[list[int]]]:
        """The next data.batch_size prompts of the sampler: their indices and token ids."""
        indices = list(self.sampler.next_batch())
        return indices, prompt_rows(self.dataset, indices)["input_ids"]

    def generation_round(self, timer: StageTimer, step: int, gen_round: int) -> Pending:
        """data.batch_size prompts drawn and their responses (with ReMax's greedy ones where the estimator takes
        them) from the current weights, seeded by slot (step, gen_round). Runs in the rollout engine's awake
        window. With rollout ranks of their own, a request they answer while the step goes on."""
        generation = self.generation
        indices = list(self.sampler.next_batch())
        prompts = prompt_rows(self.dataset, indices)
        if generation.remote is not None:
            replicas = generation.remote.replicas
            params = [generation.sampling_params(step, gen_round, replicas, replica) for replica in range(replicas)]
            pending = generation.remote.request(prompts["input_ids"], params)
            return Pending(lambda: answered_round(indices, pending, timer))
        with timer("rollout"):
            responses = generation.generate(prompts["input_ids"], step=step, gen_round=gen_round,
                                            conversations=prompts["raw_prompt"])
        greedy = None
        if uses_greedy_baseline(self.config):
            params = SamplingParams(temperature=0.0, max_new_tokens=self.config.data.max_response_length)
            with timer("remax_baseline"):
                greedy = generation.generate(prompts["input_ids"], params, conversations=prompts["raw_prompt"])
        return Pending.done(GeneratedRound(indices, responses, greedy))

    def scored_round(self, generated: GeneratedRound, step: Step
                     ) -> tuple[dict, list[Response], RewardOutput, dict]:
        """A generated round's rows (with ReMax's greedy baseline where the estimator takes it), responses,
        reward (overlong penalty included) and batch."""
        prompts, responses = prompt_rows(self.dataset, generated.indices), generated.responses
        rows = with_episodes(one_row_per_response(prompts, self.config.rollout.n), responses)
        if generated.greedy is not None:
            rows["reward_baseline"] = self.remax_baselines(prompts, generated.greedy, step)
        batch = self.batch(rows, responses)
        with step.timer("reward"):
            reward = self.scoring.shape_overlong(batch, self.scoring.agreed(batch, rows, step.number))
        return rows, responses, reward, batch

    def batch(self, rows: dict, responses: list[Response], log_probs: bool = True) -> dict:
        return responses_batch(rows, responses, self.config.data.max_response_length, self.pad_token_id, log_probs)

    def remax_baselines(self, prompts: dict, greedy: list[Response], step: Step) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy response per prompt (generated by the same engine and
        weights as the samples, in their round), scored like them, repeated for the prompt's n rows [B]; timed as
        `remax_baseline`."""
        with step.timer("remax_baseline"):
            rows = with_episodes({key: prompts[key] for key in ("input_ids", *PROMPT_FIELDS)}, greedy)
            scores = self.scoring.agreed(self.batch(rows, greedy, log_probs=False), rows, step.number).scores
        return scores.repeat_interleave(self.config.rollout.n)

    def filter_metric(self, reward: RewardOutput) -> torch.Tensor:
        """[B] what dynamic sampling compares within a group: the score, or a dict reward's extra field."""
        metric = self.config.algorithm.filter_groups.metric
        if metric == "score":
            return reward.scores
        if metric not in reward.extras:
            raise UserError(f"algorithm.filter_groups.metric={metric!r}: the reward returns no such field (its "
                            f"fields: score{''.join(', ' + name for name in reward.extras)})")
        return torch.as_tensor(reward.extras[metric], dtype=torch.float64)

    def partial_batch_rows(self, groups: GroupFilter, step_number: int) -> int:
        """Dynamic sampling out of rounds: stop (on_exhausted=stop), or the rows of the kept groups that fill whole
        actor (and critic) mini-batches, so they still split over the data-parallel ranks and micro-batches."""
        config = self.config
        filter_config = config.algorithm.filter_groups
        sizes = [config.actor.mini_batch_size] + ([config.critic.mini_batch_size] if uses_critic(config) else [])
        shortfall = (f"dynamic sampling kept {groups.kept} of data.batch_size={config.data.batch_size} groups in "
                     f"algorithm.filter_groups.max_num_gen_batches={filter_config.max_num_gen_batches} rounds")
        try:
            usable = trainable_groups(groups, filter_config.on_exhausted, sizes)
        except BatchNotFilled:
            raise UserError(f"step {step_number}: {shortfall}: too many prompts were answered all alike; raise it, "
                            "set it to 0 for no bound, or set algorithm.filter_groups.on_exhausted=train") from None
        self.note(step_number, f"{shortfall}; training on {usable} of them (whole mini-batches)")
        return usable * config.rollout.n

    def settle(self) -> None:
        """Rounds generated meanwhile (rollout ranks of their own) come back before the weights are pushed."""
        self.schedule.settle()


def answered_round(indices: list[int], pending: Pending, timer: StageTimer) -> GeneratedRound:
    """The rollout ranks' round once they answer: the training ranks' wait is `rollout_wait`, the rollout
    ranks' work for it `rollout_ranks_busy` and `rollout_ranks_cpu` (the bench's idle shares of both sides)."""
    with timer("rollout_wait"):
        responses, busy = pending.result()
    busy.count_into(timer)
    return GeneratedRound(indices, responses)
