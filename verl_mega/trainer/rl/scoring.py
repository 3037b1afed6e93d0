"""The reward of the RL step: each response scored by `reward.function` (in a worker under a time and memory
limit), by an HF reward model or by the team's service (reward.remote), the same scores on every rank, and DAPO's
soft overlong punishment added.

Every rank scores the whole batch, and a reward under a time limit (or any that is not deterministic) can differ
between ranks: `agreed` makes rank 0's the scores every rank filters and trains on. A service is asked by rank 0
alone (not once per rank), and the line that stops the run when it fails reaches every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from verl_mega.algorithms import overlong_penalty, truncated_responses
from verl_mega.config import TrainConfig
from verl_mega.config.errors import UserError
from verl_mega.rewards.registry import RewardFn
from verl_mega.rewards.remote import RemoteStats
from verl_mega.rewards.rules import no_outcome_score
from verl_mega.roles.reward import (
    HFRewardModel, RemoteReward, RewardOutput, RuleReward, decode_responses, episode_fields, scores_to_token_rewards,
)

from ..rollout_batch import response_tokens
from .step import Note


class Scoring:
    """`reward.*` of a config: score rows, agree on them, shape them; `note(step, line)` logs the run's first
    answer the scoring worker stopped."""

    def __init__(self, config: TrainConfig, rule: RuleReward | None, model: HFRewardModel | None, world_size: int,
                 note: Note, remote: RemoteReward | None = None):
        """`remote` replaces `rule` (None then), `model` scores in place of `rule`'s function."""
        self.config, self.rule, self.model, self.remote = config, rule, model, remote
        self.tokenizer = (remote or rule).tokenizer
        self.world_size, self.note = world_size, note
        self.timeout_noted = False

    @classmethod
    def build(cls, config: TrainConfig, tokenizer, world_size: int, note: Note,
              reward_fn: RewardFn | None = None) -> "Scoring":
        """`reward_fn`: a callable in place of `reward.function` (the Python API's); reward.remote.url or
        reward.reward_model replaces both. Neither, with reward.function empty: every response scores 0 (the
        teacher of algorithm.distill is the whole signal)."""
        reward = config.reward
        if reward.remote.url:
            return cls(config, None, None, world_size, note, RemoteReward(tokenizer, reward.remote))
        rule = RuleReward(tokenizer, reward_fn or reward.function or no_outcome_score, reward.timeout_s,
                          reward.memory_limit_mb, reward.code, reward.math)
        model = HFRewardModel(reward.reward_model) if reward.reward_model else None
        return cls(config, rule, model, world_size, note)

    @property
    def source(self) -> str:
        """What the scores come from, as the user configured it."""
        if self.remote is not None:
            return f"reward.remote.url {self.config.reward.remote.url}"
        return "reward.model" if self.model is not None else f"reward.function {self.rule.name!r}"

    @property
    def counts_timeouts(self) -> bool:
        """Whether answers can be stopped by the scoring worker's limits or death (reward/timeouts and
        reward/worker_deaths are logged)."""
        return self.rule is not None and self.rule.worker is not None

    def score(self, batch: dict, rows: dict, step_number: int) -> RewardOutput:
        """Sequence scores [B], the same placed on each response's last token [B, R], and a dict reward's extra
        fields (none for a reward model)."""
        if self.model is not None:
            texts = self.decode(batch["responses"], batch["response_mask"])
            scores = self.model.score(rows["raw_prompt"], texts).float().cpu()
            return RewardOutput(scores, scores_to_token_rewards(scores, batch["response_mask"]))
        truths = [(info or {}).get("ground_truth") for info in rows["reward_model"]]
        extra_infos, episodes = rows.get("extra_info"), rows.get("episode")
        if extra_infos is None:
            extra_infos = [None] * len(truths)
        if episodes is not None:  # the reward sees the whole episode; its answer is the last assistant turn
            extra_infos = [episode_fields(episode, info) for episode, info in zip(episodes, extra_infos)]
        if self.remote is not None:
            return self.remote(batch["responses"], batch["response_mask"], rows["raw_prompt"], truths,
                               rows["data_source"], extra_infos, episodes=episodes)
        reward = self.rule(batch["responses"], batch["response_mask"], truths, rows["data_source"], extra_infos,
                           episodes=episodes)
        self.note_first_timeout(reward, rows, step_number)
        return reward

    def agreed(self, batch: dict, rows: dict, step_number: int) -> RewardOutput:
        """Collective: `score`, rank 0's on every rank. A service is asked by rank 0 only; its failure (the line
        that stops the run) is raised on every rank."""
        if self.world_size == 1:
            return with_agent_rewards(self.score(batch, rows, step_number), rows, batch["response_mask"])
        if self.remote is None:
            shared = [self.score(batch, rows, step_number)]
        else:
            shared = [self.remote_outcome(batch, rows, step_number) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        if isinstance(shared[0], UserError):
            raise shared[0]
        return with_agent_rewards(shared[0], rows, batch["response_mask"])

    def remote_outcome(self, batch: dict, rows: dict, step_number: int) -> RewardOutput | UserError:
        try:
            return self.score(batch, rows, step_number)
        except UserError as err:
            return err

    def remote_stats(self) -> RemoteStats:
        """The service's requests since the last call (none on the ranks that do not ask it)."""
        return self.remote.drain()

    def note_first_timeout(self, reward: RewardOutput, rows: dict, step_number: int) -> None:
        """The run's first answer stopped by the scoring worker's limits goes to the log; later ones are only
        counted (reward/timeouts), so a policy that learns to emit them does not flood it."""
        if not reward.timeouts or self.timeout_noted:
            return
        row, reason = next(iter(reward.timeouts.items()))
        self.note(step_number, f"reward.function {self.rule.name!r} on response {row} (data_source "
                               f"{rows['data_source'][row]!r}) {reason}: scored 0, its worker replaced; later "
                               "ones are counted in reward/timeouts, not logged")
        self.timeout_noted = True

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

    def overlong_metrics(self, generated: dict, eos_token_ids: list[int]) -> dict[str, float]:
        """The share of truncated responses and their mean overlong penalty, where either feature is on, from
        the generated `responses` and their `response_tokens` (every response token)."""
        buffer, mask = self.config.reward.overlong_buffer, generated["response_tokens"]
        if not (buffer.enable or self.config.algorithm.overlong_filtering):
            return {}
        truncated = truncated_responses(generated["responses"], mask, eos_token_ids)
        metrics = {"dapo/overlong_fraction": truncated.float().mean().item()}
        if buffer.enable:
            metrics["dapo/overlong_penalty_mean"] = overlong_penalty(
                mask.sum(dim=-1), self.config.data.max_response_length, buffer.len, buffer.penalty_factor
            ).mean().item()
        return metrics

    def decode(self, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
        """The responses' text with special tokens dropped."""
        return decode_responses(self.tokenizer, responses, mask)

    def close(self) -> None:
        if self.rule is not None:
            self.rule.close()


def with_agent_rewards(reward: RewardOutput, rows: dict, response_mask: torch.Tensor) -> RewardOutput:
    """The rows whose agent returned a reward through the rollout endpoint (`EpisodeInfo.agent_reward`, the same
    on every rank) scored by it, at their last response token, in place of the reward's score."""
    episodes = rows.get("episode") or []
    own = [row for row, episode in enumerate(episodes) if episode.agent_reward is not None]
    if not own:
        return reward
    scores, token_level = reward.scores.clone(), reward.token_level_rewards.clone()
    scores[own] = torch.tensor([episodes[row].agent_reward for row in own], dtype=scores.dtype)
    token_level[own] = scores_to_token_rewards(scores[own], response_mask[own]).to(token_level)
    return reward._replace(scores=scores, token_level_rewards=token_level)
