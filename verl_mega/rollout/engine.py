"""What every rollout engine offers, and the sampling parameters they all read the same way."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from verl_mega.config.ranges import at_least
from verl_mega.parallel.layout import rollout_vocab_rows


@dataclass(frozen=True)
class SamplingParams:
    """Generation stops at the model's EOS token, at any of `stop_token_ids` (the stop token is kept in the
    response), or after `max_new_tokens`. `temperature=0` is greedy; `top_k=-1` and `top_p=1` are off.
    With `logprobs`, each response carries the log-probability of each of its tokens under the distribution it
    was sampled from, taken in the same step (no extra pass): softmax(logits / temperature), greedy counting as
    temperature 1; where top-k / top-p are on, that distribution is the filtered one, renormalised over the
    tokens kept (vLLM's `processed_logprobs`, the only form vLLM reports with the temperature applied), so the
    log-prob is then larger than the unfiltered one by -log(the probability mass kept).
    With `routed_experts` (an MoE model, an engine whose `records_routing`), each response also carries the
    experts its tokens were routed to (`Response.routed_experts`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    routed_experts: bool = False

    def __post_init__(self):
        if not at_least(0).admits(self.temperature):  # NaN passed `< 0` and sampled from NaN probabilities
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class WeightFeed:
    """What `RolloutEngine.load_weights` receives on this rank: the HybridEngine's stream at `rollout_tp`.

    - rollout_tp 1: every tensor is the whole HF tensor (vocabulary padding removed).
    - rollout_tp t > 1: every tensor is this rank's rollout TP slice (`rollout_tp_rank` of t), HF names:
      column-parallel weights (q/k/v, gate/up, expert w1/w3) split along dim 0 per head group / matrix,
      row-parallel ones (o_proj, down_proj, expert w2) along dim 1, norms whole; the embedding and an
      untied LM head are megatron's vocabulary partition: the real rows `vocab_rows(rollout_tp_rank)` of a
      table padded to `padded_vocab` rows and split evenly into t parts (the last parts lose their padding).
    """

    rollout_tp: int
    rollout_tp_rank: int
    padded_vocab: int
    vocab_size: int

    @property
    def presliced(self) -> bool:
        return self.rollout_tp > 1

    def vocab_rows(self, part: int) -> range:
        return rollout_vocab_rows(self.padded_vocab, self.vocab_size, part, self.rollout_tp)


@dataclass(frozen=True)
class EpisodeInfo:
    """What a multi-turn episode (rollout.agent_loop) did, for the reward, the metrics and the logged samples.
    `prompt_ids`: its prompt as rendered with the tools' schemas; `messages`: the prompt's messages, then each
    assistant turn and tool result as the chat template saw them; `tool_calls` / `tool_results`: one JSON dict
    each per call, in order, with the turn it came from; `turn_ends`: the response position of each assistant
    turn's last sampled token; `truncated`: the budget or max_turns ended it before the model did;
    `agent_reward`: the score the user's agent returned for it through the rollout endpoint, which takes the place
    of the reward's score; None: the reward scores it."""

    prompt_ids: list[int]
    messages: list[dict]
    tool_calls: list[dict]
    tool_results: list[dict]
    turn_ends: list[int]
    truncated: bool
    agent_reward: float | None = None


@dataclass(frozen=True)
class Response:
    """A response's token ids (and their log-probs). A multi-turn episode also carries `loss_mask` (1 on the
    ids the model sampled, 0 on the chat template's ids for tool results; its log-probs are 0 there) and
    `episode`; a single-turn response has neither: every id is sampled. `routed_experts`: [prompt tokens +
    response tokens - 1, moe_layers, top_k] int16, the top-k experts each MoE layer (in layer order) chose for
    every token the engine ran through the model: the prompt's, at its prefill, then each response token's but
    the last, which is never fed back. `token_versions`: the weight version that sampled each response token (a
    partial rollout's tokens may come from several versions, `rollout.partial`); None where versions are not
    tracked."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    loss_mask: list[int] | None = None
    episode: EpisodeInfo | None = None
    routed_experts: torch.Tensor | None = field(default=None, compare=False)  # a tensor has no truth value for ==
    token_versions: tuple[int, ...] | None = None


class RolloutEngine(ABC):
    """Weights arrive from the HybridEngine's stream; memory is given back between rollouts."""

    # Whether `generate` can return `Response.routed_experts` (`SamplingParams.routed_experts`) for an MoE model.
    records_routing = False

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Response]:
        """`params.n` responses per prompt, prompt-major: responses of prompt 0 first."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy `(hf_name, tensor)` pairs, laid out as the engine's `WeightFeed` says, into its model in
        place; returns how many were loaded. A tensor may be a view of a live training parameter, valid until
        the next one is drawn: copy it, never keep or write it."""

    @abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Give back accelerator memory (1: KV cache, weights kept off-device; 2: weights dropped too)."""

    @abstractmethod
    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take memory back: `["weights"]` before `load_weights`, `["kv_cache"]` after; None for both."""

    def close(self) -> None:
        """Release what the engine holds beyond Python objects (vLLM's process groups), before the job's
        own process groups are destroyed."""
