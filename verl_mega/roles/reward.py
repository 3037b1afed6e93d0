"""The reward role: rule-based scores for verifiable tasks, a learned reward model, or a scoring service of the
team's own (reward.remote: its JSON API or an LLM judge, docs/remote-rewards.md).

Rule reward functions (verl_mega.rewards) share verl's `compute_score` signature,
`fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`, so verl reward files can be
used unchanged through a "module:function" path (the Python API hands over the function itself). A named
function other than the linear-time string comparisons runs in the scoring worker, under `reward.timeout_s`
per answer. Sequence scores become token-level rewards at the last valid response token, where PPO/GRPO
advantage estimation expects the outcome reward.

A multi-turn episode (rollout.multi_turn) is scored on its last assistant turn as `solution_str`, with the whole
episode in `extra_info` (`episode_fields`: messages, tool calls and results, turns); a dict reward's
`turn_scores` (a number per assistant turn) are added at each turn's last sampled token.
"""
from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple, Sequence

import torch
from transformers import AutoModelForSequenceClassification

from verl_mega.config.errors import UserError
from verl_mega.config.schema import REMOTE_KINDS, RemoteRewardConfig, RewardCodeConfig, RewardConfig, RewardMathConfig
from verl_mega.data.prompts import as_messages, encode_chat
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.rewards import code_tests, math_answers
from verl_mega.rewards.judge import Judge, check_template, compile_pattern, load_template
from verl_mega.rewards.registry import RewardFn, get_reward_fn, needs_time_limit, reward_fn_name
from verl_mega.rewards.results import Died, OutOfRange, Scored, Stopped, Verdict, as_number, call_reward, described
from verl_mega.rewards.remote import RemoteClient, RemoteStats, json_row, score_json
from verl_mega.rewards.worker import ScoringWorker

logger = logging.getLogger(__name__)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores -> [B, T] rewards, each score at its row's last valid response token, zero elsewhere."""
    valid = response_mask.bool()
    empty_rows = (~valid.any(dim=-1)).nonzero().flatten().tolist()
    if empty_rows:
        raise ValueError(f"response rows {empty_rows} have no valid tokens to carry their reward")
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last_valid = torch.where(valid, positions, -1).max(dim=-1).values
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    token_rewards[torch.arange(len(scores), device=response_mask.device), last_valid] = scores.to(token_rewards)
    return token_rewards


class RewardOutput(NamedTuple):
    scores: torch.Tensor  # [B]
    token_level_rewards: torch.Tensor  # [B, T]
    extras: dict[str, torch.Tensor] = {}  # a dict reward's numeric fields, [B] each (NaN where a row lacks one)
    sample_fields: tuple[dict, ...] = ()  # per row: its non-numeric fields, for the logged samples
    timeouts: dict[int, str] = {}  # rows a scoring-worker limit stopped (scored 0) -> why
    worker_deaths: dict[int, str] = {}  # rows the scoring worker died on (scored 0) -> its exit code

    def take(self, rows: Sequence[int]) -> RewardOutput:
        """The reward of `rows` only, in that order (the timeouts' and deaths' rows renumbered)."""
        rows = list(rows)
        index = torch.as_tensor(rows, dtype=torch.long)
        position = {row: i for i, row in enumerate(rows)}
        return RewardOutput(self.scores[index], self.token_level_rewards[index],
                            {name: values[index] for name, values in self.extras.items()},
                            tuple(self.sample_fields[row] for row in rows) if self.sample_fields else (),
                            _renumbered(self.timeouts, position), _renumbered(self.worker_deaths, position))

    @staticmethod
    def concat(parts: Sequence[RewardOutput]) -> RewardOutput:
        """The rewards of `parts` one after the other; a dict field some part lacks is NaN on its rows."""
        sizes = [len(part.scores) for part in parts]
        offsets = [sum(sizes[:i]) for i in range(len(parts))]
        names = list(dict.fromkeys(name for part in parts for name in part.extras))
        extras = {name: torch.cat([part.extras[name] if name in part.extras else torch.full((size,), float("nan"))
                                   for part, size in zip(parts, sizes)]) for name in names}
        with_fields = any(part.sample_fields for part in parts)
        sample_fields = tuple(fields for part, size in zip(parts, sizes)
                              for fields in (part.sample_fields or ({},) * size)) if with_fields else ()
        timeouts = {offset + row: why for part, offset in zip(parts, offsets) for row, why in part.timeouts.items()}
        deaths = {offset + row: why for part, offset in zip(parts, offsets) for row, why in part.worker_deaths.items()}
        return RewardOutput(torch.cat([part.scores for part in parts]),
                            torch.cat([part.token_level_rewards for part in parts]), extras, sample_fields, timeouts,
                            deaths)


def _renumbered(reasons: dict[int, str], position: dict[int, int]) -> dict[int, str]:
    """`reasons` of the rows kept, under their new numbers."""
    return {position[row]: why for row, why in reasons.items() if row in position}


def decode_responses(tokenizer, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """The responses' valid tokens as text, special tokens dropped."""
    valid_ids = [[token for token, valid in zip(row, mask) if valid]
                 for row, mask in zip(responses.tolist(), response_mask.tolist())]
    return tokenizer.batch_decode(valid_ids, skip_special_tokens=True)


class RuleReward:
    """A rule reward function over decoded responses. `timeout_s` > 0 runs a named function (except the
    linear-time ones) in the scoring worker, with that limit per answer and `memory_limit_mb` for its heap;
    `code`: the limits of code tests (reward.code), `math` the math-verify rewards' options (reward.math),
    wherever they run. `close()` ends the worker."""

    def __init__(self, tokenizer, reward_fn: str | RewardFn = "exact_match",
                 timeout_s: float = RewardConfig.timeout_s, memory_limit_mb: int = RewardConfig.memory_limit_mb,
                 code: RewardCodeConfig = RewardCodeConfig(), math: RewardMathConfig = RewardMathConfig()):
        self.tokenizer = tokenizer
        self.name = reward_fn_name(reward_fn)
        self.reward_fn = get_reward_fn(reward_fn)
        code_tests.configure(code)
        math_answers.configure(math)
        limited = timeout_s > 0 and needs_time_limit(reward_fn)
        self.worker = ScoringWorker(self.name, timeout_s, memory_limit_mb, code, math) if limited else None

    def decode(self, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        return decode_responses(self.tokenizer, responses, response_mask)

    def __call__(
        self,
        responses: torch.Tensor,
        response_mask: torch.Tensor,
        ground_truths: Sequence[Any],
        data_sources: Sequence[Any] | None = None,
        extra_infos: Sequence[Any] | None = None,
        episodes: Sequence | None = None,  # multi-turn: each row's rollout.engine.EpisodeInfo
    ) -> RewardOutput:
        batch_size = len(responses)
        data_sources = data_sources if data_sources is not None else [None] * batch_size
        extra_infos = extra_infos if extra_infos is not None else [None] * batch_size
        texts = self.decode(responses, response_mask) if episodes is None else [final_answer(e) for e in episodes]
        rows = list(zip(data_sources, texts, ground_truths, extra_infos, strict=True))
        verdicts = self.worker.score(rows) if self.worker else [call_reward(self.reward_fn, row) for row in rows]
        timeouts = {row: verdict.reason for row, verdict in enumerate(verdicts) if isinstance(verdict, Stopped)}
        deaths = {row: verdict.reason for row, verdict in enumerate(verdicts) if isinstance(verdict, Died)}
        if deaths:  # rare and never the answer's fault alone: said at once, not only counted
            row, reason = next(iter(deaths.items()))
            logger.warning("reward.function %r: %s (response %d, data_source %r), and on %d more in this batch; "
                           "scored 0, counted in reward/worker_deaths", self.name, reason, row, data_sources[row],
                           len(deaths) - 1)
        scored = [self._scored(row, verdict, source) for row, (verdict, source) in enumerate(zip(verdicts,
                                                                                                data_sources))]
        # NaN/inf pass through: the trainer stops or skips the batch (trainer.nonfinite) and names the rows.
        reward = scored_output(scored, response_mask)
        if episodes is not None:
            reward.token_level_rewards.add_(self._turn_rewards(scored, episodes, reward.token_level_rewards.shape))
        return reward._replace(timeouts=timeouts, worker_deaths=deaths)

    def _turn_rewards(self, scored: Sequence[Scored], episodes: Sequence, shape) -> torch.Tensor:
        """[B, R] a dict reward's `turn_scores` (one number per assistant turn), each at its turn's last sampled
        token; zero for rows without them."""
        rewards = torch.zeros(shape, dtype=torch.float32)
        for row, (result, episode) in enumerate(zip(scored, episodes)):
            turn_scores = result.fields.get("turn_scores")
            if turn_scores is None:
                continue
            numbers = _turn_numbers(turn_scores)
            if None in numbers or len(numbers) != len(episode.turn_ends):
                raise UserError(f"reward.function {self.name!r} on response {row}: turn_scores must be a list of "
                                f"{len(episode.turn_ends)} numbers within a float32 score's range (one per "
                                f"assistant turn), got {described(turn_scores)}")
            for end, value in zip(episode.turn_ends, numbers):
                if end < shape[1]:
                    rewards[row, end] += value
        return rewards

    def _scored(self, row: int, verdict: Verdict, source) -> Scored:
        """A stopped answer, or one the worker died on, scores 0; a function that raised, exited or returned a
        non-score is the user's to fix."""
        if isinstance(verdict, (Stopped, Died)):
            return Scored(0.0, {}, {})
        if isinstance(verdict, Scored):
            return verdict
        raise UserError(f"reward.function {self.name!r} on response {row} (data_source {source!r}): "
                        f"{verdict.problem}")

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _turn_numbers(turn_scores) -> list[float | None]:
    """Each turn score as a number, None for one that is not a number or is out of a float32 score's range."""
    if not isinstance(turn_scores, list):
        return [None]
    numbers = []
    for value in turn_scores:
        try:
            numbers.append(as_number(value))
        except OutOfRange:
            numbers.append(None)
    return numbers


def scored_output(scored: Sequence[Scored], response_mask: torch.Tensor) -> RewardOutput:
    """The reward of rows scored each by a function or a service, the scores at each response's last token."""
    scores = torch.tensor([result.score for result in scored], dtype=torch.float32)
    return RewardOutput(scores, scores_to_token_rewards(scores, response_mask.cpu()), numeric_fields(scored),
                        tuple(result.fields for result in scored))


class RemoteReward:
    """reward.remote: each response scored by the team's service (docs/remote-rewards.md), its JSON scoring API or
    an LLM judge; the run stops (RemoteRewardError, naming the URL) where the service cannot score a batch.
    `drain()` hands over the requests' statistics since the last call."""

    def __init__(self, tokenizer, remote: RemoteRewardConfig):
        self.tokenizer, self.remote = tokenizer, remote
        self.client = RemoteClient(remote.url, max_concurrency=remote.max_concurrency, timeout_s=remote.timeout_s,
                                   max_retries=remote.max_retries, backoff_s=remote.backoff_s,
                                   max_consecutive_failures=remote.max_consecutive_failures,
                                   api_key_env=remote.api_key_env)
        self.judge = Judge(self.client, remote.model, remote.prompt_template, remote.score_pattern,
                           remote.score_scale, remote.max_tokens) if remote.kind == "judge" else None

    def __call__(self, responses: torch.Tensor, response_mask: torch.Tensor, prompts: Sequence[Any],
                 ground_truths: Sequence[Any], data_sources: Sequence[Any], extra_infos: Sequence[Any],
                 episodes: Sequence | None = None) -> RewardOutput:
        """As RuleReward's, with each row's prompt (its text or chat messages) for the service."""
        texts = (decode_responses(self.tokenizer, responses, response_mask) if episodes is None
                 else [final_answer(episode) for episode in episodes])
        rows = [json_row(*row) for row in zip(data_sources, prompts, texts, ground_truths, extra_infos, strict=True)]
        scored = self.judge.score(rows) if self.judge else score_json(self.client, rows, self.remote.batch_size)
        return scored_output(scored, response_mask)

    def drain(self) -> RemoteStats:
        return self.client.drain()


def remote_problems(remote: RemoteRewardConfig, reward_model: str) -> list[str]:
    """What in reward.remote (set) stops it from scoring: each a line naming its key."""
    problems = []
    if reward_model:
        problems.append("reward.remote.url and reward.reward_model are both set: one scores the responses; unset "
                        "one of them")
    if not remote.url.startswith(("http://", "https://")):
        problems.append(f"reward.remote.url {remote.url!r} is no http:// or https:// URL")
    if remote.kind not in REMOTE_KINDS:
        problems.append(f"reward.remote.kind '{remote.kind}' is unknown; known: {', '.join(REMOTE_KINDS)}")
    if remote.api_key_env and not os.environ.get(remote.api_key_env):
        problems.append(f"reward.remote.api_key_env: the environment variable {remote.api_key_env} is not set "
                        "(it holds the service's key)")
    if remote.kind == "judge":
        if not remote.model:
            problems.append("reward.remote.model is empty: name the model the judge's server serves")
        for check in (lambda: check_template(load_template(remote.prompt_template)),
                      lambda: compile_pattern(remote.score_pattern)):
            try:
                check()
            except (ValueError, OSError) as err:
                problems.append(str(err))
    return problems


def final_answer(episode) -> str:
    """A multi-turn episode's answer (a rollout.engine.EpisodeInfo; the roles sit beside rollout, so it is not
    imported), as its reward scores it: the content of its last assistant turn."""
    return next((message["content"] for message in reversed(episode.messages) if message["role"] == "assistant"), "")


def episode_fields(episode, extra_info: Any) -> dict:
    """`extra_info` for a multi-turn episode's reward: the row's own (its keys, or under "extra_info" where it
    is not a dict), plus the episode's messages, tool calls, tool results, turns and whether it was truncated."""
    own = dict(extra_info) if isinstance(extra_info, dict) else ({} if extra_info is None else
                                                                 {"extra_info": extra_info})
    return {**own, "messages": episode.messages, "tool_calls": episode.tool_calls,
            "tool_results": episode.tool_results, "turns": len(episode.turn_ends), "truncated": episode.truncated}


def numeric_fields(scored: Sequence[Scored]) -> dict[str, torch.Tensor]:
    """Each numeric field of the rows' dicts as a [B] float32 tensor, NaN in the rows without it."""
    names = sorted({name for result in scored for name in result.metrics})
    return {name: torch.tensor([result.metrics.get(name, float("nan")) for result in scored], dtype=torch.float32)
            for name in names}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class HFRewardModel:
    """A sequence-classification reward model with a single label; its logit is the score."""

    def __init__(self, model_dir: str, device: str | torch.device | None = None):
        self.device = torch.device(device) if device is not None else default_device()
        self.tokenizer = load_tokenizer(model_dir)
        if self.tokenizer.pad_token_id is None:
            raise UserError(f"the reward model tokenizer in {model_dir} has no pad token to batch with")
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise UserError(f"reward model in {model_dir} has {self.model.config.num_labels} labels; expected 1")
        # The model reads its score at the rightmost non-pad token, so it must know the pad id.
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def _encode(self, prompt: str | list[dict], response: str) -> list[int]:
        if self.tokenizer.chat_template:
            conversation = as_messages(prompt) + [{"role": "assistant", "content": response}]
            return encode_chat(self.tokenizer, conversation, add_generation_prompt=False)
        if not isinstance(prompt, str):
            raise ValueError("prompt is a list of chat messages but the reward model tokenizer has no chat_template")
        return self.tokenizer(prompt + response)["input_ids"]

    @torch.no_grad()
    def score(self, prompts: Sequence[str | list[dict]], responses: Sequence[str]) -> torch.Tensor:
        """[B] float32 scores on the CPU, from prompt and response texts (the policy's tokens are not
        reused: the reward model may have a different vocabulary and chat template)."""
        encoded = [self._encode(prompt, response) for prompt, response in zip(prompts, responses, strict=True)]
        # Right padding keeps each sequence's positions as they are unpadded; the model's forward
        # does not derive position ids from the attention mask.
        batch = self.tokenizer.pad({"input_ids": encoded}, padding=True, padding_side="right", return_tensors="pt")
        logits = self.model(
            input_ids=batch["input_ids"].to(self.device), attention_mask=batch["attention_mask"].to(self.device)
        ).logits
        return logits[:, 0].float().cpu()
