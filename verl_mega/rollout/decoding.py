"""Sampled decoding with a transformers model's forward and KV cache: the embedded engine's generation loop.

transformers' `generate` is general (beam search, streamers, dozens of processors) and pays for it on every
token. What a rollout needs is narrower, and four things make this loop cheaper:
- Each prompt is prefilled once and its KV cache shared by its `n` samples (`generate` prefills every copy).
- A draw is one uniform number per row, placed in the float64 cumulative distribution; `torch.multinomial`
  draws an exponential variate per vocabulary entry (15 % of a 100M model's decoding on the CPU).
- Rows that have stopped leave the batch once a quarter of it has: no forward is spent on finished rows.
- Each layer's KV cache is written into room reserved for the whole response, where transformers' dynamic
  cache concatenates (copying the whole cache at every token: quadratic in the response length).
Sampling follows `SamplingParams`: temperature, then top-k, then top-p (as transformers and vLLM order them).
The log-prob returned with each token is taken from the same filtered logits the token was drawn from, so it
costs one log-softmax per step and no extra forward (see `SamplingParams.logprobs`).
With a `RouterRecorder` (an MoE model, `SamplingParams.routed_experts`), each row also gets the experts every
token it ran through the model was routed to: its prompt's (from the shared prefill), then its response's but
the last (never fed back).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .engine import SamplingParams
from .routing import RouterRecorder

# Finished rows are dropped from the batch once they are this fraction of it: each drop copies the KV cache of
# the rows left, so dropping at every stop would copy it up to once per row.
DROP_FINISHED_AT = 0.25


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [rows, vocab] scaled by the temperature, with entries outside top-k / top-p set to -inf."""
    logits = logits.float() if params.temperature == 1 else logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1:
        ascending, order = torch.sort(logits, dim=-1)
        outside = ascending.softmax(-1).cumsum(-1) <= 1 - params.top_p
        outside[..., -1] = False  # the most likely token always stays
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


def sampling_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The float32 logits of the distribution a token is drawn from: the raw ones when greedy (greedy counts as
    temperature 1, as vLLM's greedy log-probs do), else `filtered_logits`."""
    return logits.float() if params.greedy else filtered_logits(logits, params)


def draw(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One token per row: the argmax when greedy, else a draw from softmax(filtered logits)."""
    return draw_from(sampling_logits(logits, params), params.greedy)


def draw_from(scores: torch.Tensor, greedy: bool) -> torch.Tensor:
    """One token per row of `sampling_logits`' output: its argmax when greedy, else a draw from its softmax."""
    if greedy:
        return scores.argmax(-1)
    cumulative = scores.softmax(-1).double().cumsum(-1)
    uniform = torch.rand(cumulative.shape[0], 1, dtype=torch.float64, device=cumulative.device)
    # The first entry whose cumulative probability exceeds u: entry i with probability p_i is drawn when u
    # falls in its interval of width p_i; float64 keeps those widths exact to ~1e-16 even over 150k entries.
    drawn = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True)
    return drawn.clamp_(max=cumulative.shape[-1] - 1).squeeze(-1)


@dataclass
class Decoded:
    tokens: list[list[int]]  # per row, prompt-major (the n samples of prompt 0 first), ending at a stop token
    logprobs: list[list[float]] | None  # of those tokens, under the distribution each was drawn from
    # per row [prompt tokens + response tokens - 1, moe_layers, top_k]: the experts of each token the model ran
    routed_experts: list[torch.Tensor] | None = None


def decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
           stop_token_ids: set[int], recorder: RouterRecorder | None = None) -> Decoded:
    """`params.n` continuations of each left-padded prompt row of `input_ids`, until a stop token or
    `params.max_new_tokens`; call under `torch.no_grad()`, inside `recorder` (entered) to record the routing."""
    device, n = input_ids.device, params.n
    cache = DynamicCache(config=model.config)
    capacity = input_ids.shape[1] + params.max_new_tokens
    cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    cached = {_cache_argument(model): cache}
    positions = (attention_mask.cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **cached,
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    routing = None if recorder is None else _Routing(recorder, input_ids, attention_mask, params)
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits, attention_mask = logits.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0)
    position = positions[:, -1:].repeat_interleave(n, 0)

    rows = input_ids.shape[0] * n
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] | None = [[] for _ in range(rows)] if params.logprobs else None
    finished = [False] * rows
    active = list(range(rows))  # the row each batch entry continues
    for step in range(params.max_new_tokens):
        scores = sampling_logits(logits, params)
        token = draw_from(scores, params.greedy)
        token_logprobs = (scores.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1).tolist()
                          if logprobs is not None else None)
        for entry, (row, value) in enumerate(zip(active, token.tolist())):
            if not finished[row]:
                tokens[row].append(value)
                if token_logprobs is not None:
                    logprobs[row].append(token_logprobs[entry])
                finished[row] = value in stop_token_ids
        if step == params.max_new_tokens - 1 or all(finished):
            break
        running = [entry for entry, row in enumerate(active) if not finished[row]]
        if len(running) <= (1 - DROP_FINISHED_AT) * len(active):
            keep = torch.tensor(running, device=device)
            cache.batch_select_indices(keep)
            active = [active[entry] for entry in running]
            token, attention_mask, position = token[keep], attention_mask[keep], position[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=-1)
        position = position + 1
        logits = model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=position, **cached,
                       use_cache=True).logits[:, -1]
        if routing is not None:
            routing.record_step(active, step)
    return Decoded(tokens, logprobs, None if routing is None else routing.per_row(tokens, n))


class _Routing:
    """The routing of one `decode`: each prompt's from the prefill, then each step's fed token per row."""

    def __init__(self, recorder: RouterRecorder, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 params: SamplingParams):
        self.recorder = recorder
        prefill = recorder.take(*input_ids.shape).cpu()
        valid = attention_mask.bool().cpu()
        self.prompts = [prefill[row][valid[row]] for row in range(len(prefill))]
        rows = input_ids.shape[0] * params.n
        # The token fed at step s is response token s of the rows still generating; -1 until written.
        self.steps = prefill.new_full((rows, params.max_new_tokens, *prefill.shape[2:]), -1)

    def record_step(self, active: list[int], step: int) -> None:
        self.steps[active, step] = self.recorder.take(len(active), 1)[:, 0].cpu()

    def per_row(self, tokens: list[list[int]], n: int) -> list[torch.Tensor]:
        return [torch.cat([self.prompts[row // n], self.steps[row, :len(row_tokens) - 1]])
                for row, row_tokens in enumerate(tokens)]


class ReservedLayer(DynamicLayer):
    """transformers' full-attention cache layer, writing new keys and values into room reserved for `capacity`
    tokens; the cache it hands out is a prefix view of that room. Sliding-window layers keep their own class."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.key_room = self.value_room = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        # After batch_repeat_interleave or batch_select_indices (new tensors) the cache moves into new room.
        if not (self._in_room(self.keys, self.key_room, end) and self._in_room(self.values, self.value_room, end)):
            self.key_room = self._reserve(self.keys, key_states, length, end)
            self.value_room = self._reserve(self.values, value_states, length, end)
        self.key_room[..., length:end, :].copy_(key_states)
        self.value_room[..., length:end, :].copy_(value_states)
        self.keys, self.values = self.key_room[..., :end, :], self.value_room[..., :end, :]
        return self.keys, self.values

    @staticmethod
    def _in_room(cached: torch.Tensor, room: torch.Tensor | None, end: int) -> bool:
        return (room is not None and end <= room.shape[-2] and cached.shape[:2] == room.shape[:2]
                and (cached.numel() == 0 or cached.data_ptr() == room.data_ptr()))

    def _reserve(self, cached: torch.Tensor, new: torch.Tensor, length: int, end: int) -> torch.Tensor:
        rows, heads, _, head_dim = new.shape
        room = new.new_empty(rows, heads, max(self.capacity, end), head_dim)
        if length:
            room[..., :length, :].copy_(cached)
        return room


def _cache_argument(model) -> str:
    """The forward's name for the KV cache: `cache` in current transformers, `past_key_values` in earlier 5.x
    releases; current ones still take the old name (until 5.40) at the price of a deprecation warning per call,
    3.5 % of a tiny model's decode step."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
