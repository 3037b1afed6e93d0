"""The trajectory buffer of asynchronous rollouts: a bounded FIFO of finished groups, each tagged with the weight
versions its tokens were sampled by.

A group is the `rollout.n` responses of one prompt with the prompt's row fields and its sampler index: the unit a
GRPO-style step trains on. Rollouts `put` groups as they finish; a step `take`s the oldest ones whose oldest
token is at most `max_staleness` versions behind the current weights, and drops (and counts in `dropped_stale`)
those that have grown older than that. Producers and the consumer may run in different threads (colocated async
fills it from a thread): every method takes the buffer's lock.

Full buffer: `put` waits up to `timeout` seconds for room (0, the default: not at all; None: as long as it takes)
and returns False if there is still none, so a producer thread is held back (backpressure) and a producer in the
trainer's own thread is never blocked by itself. `take` likewise waits up to `timeout` for enough fresh groups,
else returns None and takes nothing.

`PendingGroups` gathers a partial rollout's finished responses into groups: the n samples of a prompt finish at
different steps.

Both save plain JSON types (`state_dict`), which a job state (trainer_state.json) holds as they are; loading
checks every entry, as a checkpoint file is read as hostile input, against what the run admits (`RunBounds`: its
dataset, vocabulary, lengths and newest weight version).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from .engine import EpisodeInfo, Response
from verl_mega.files.plain_state import check_plain, count, entry, floats, ints


@dataclass(frozen=True)
class RunBounds:
    """What a saved state may hold in this run: prompts (sampler indices) below `prompts`, the dataset's size;
    token ids below `vocab_size`; prompts of at most `max_prompt_tokens` and responses of at most
    `max_response_tokens` tokens (data.max_prompt_length, data.max_response_length); weight versions up to
    `newest_version`, the checkpoint's step (no token comes from weights the run had not made yet)."""

    prompts: int
    vocab_size: int
    max_prompt_tokens: int
    max_response_tokens: int
    newest_version: int

    def index(self, state: Any, key: str, what: str) -> int:
        return count(state, key, what, high=self.prompts - 1, note=f" (data.train_files hold {self.prompts} prompts)")

    def tokens(self, value: Any, what: str, longest: int) -> list[int]:
        """Token ids, at most `longest` of them (counted first: a list this run could not hold is not walked)."""
        if isinstance(value, list) and len(value) > longest:
            raise ValueError(f"{what} holds {len(value)} tokens, more than this run's {longest}")
        return ints(value, what, low=0, high=self.vocab_size - 1)

    def versions(self, value: Any, what: str) -> list[int]:
        return ints(value, what, low=0, high=self.newest_version)


# The bounds of a state this run made itself and shares between its ranks: checked when it was loaded or made.
UNBOUNDED = RunBounds(*(2**63,) * 5)


@dataclass(frozen=True)
class Group:
    """The responses of one prompt (each with `token_versions`), the prompt's row fields (JSON types: its
    input_ids, raw_prompt, data_source, reward_model, extra_info, ...) and its sampler index."""

    index: int
    prompt: dict
    responses: tuple[Response, ...]
    oldest_version: int = field(init=False)  # of its tokens: its staleness
    newest_version: int = field(init=False)

    def __post_init__(self):
        if type(self.index) is not int or self.index < 0:
            raise ValueError(f"a group's sampler index must be an integer >= 0, got {self.index!r}")
        check_prompt_fields(self.prompt, "a group's prompt fields")
        versions = [v for response in self.responses for v in _versions(response)]
        if not versions:
            raise ValueError(f"the group of prompt {self.index} has no tokens, so no version")
        object.__setattr__(self, "responses", tuple(self.responses))
        object.__setattr__(self, "oldest_version", min(versions))
        object.__setattr__(self, "newest_version", max(versions))


class TrajectoryBuffer:
    """At most `capacity` finished groups, oldest put first (see the module docstring)."""

    def __init__(self, capacity: int):
        if type(capacity) is not int or capacity < 1:
            raise ValueError(f"the trajectory buffer's capacity must be an integer >= 1, got {capacity!r}")
        self.capacity = capacity
        self.dropped_stale = 0  # groups dropped by `take` for being older than max_staleness
        self._groups: deque[Group] = deque()
        self._changed = threading.Condition()

    def put(self, group: Group, timeout: float | None = 0.0) -> bool:
        """Append `group`, waiting up to `timeout` seconds for room; False if the buffer stayed full."""
        if not isinstance(group, Group):
            raise TypeError(f"the trajectory buffer holds Group objects, got {type(group).__name__}")
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._groups) < self.capacity, timeout):
                return False
            self._groups.append(group)
            self._changed.notify_all()
            return True

    def take(self, n_groups: int, current_version: int, max_staleness: int, timeout: float | None = 0.0
             ) -> list[Group] | None:
        """The `n_groups` first-put groups whose oldest token is at most `max_staleness` versions older than
        `current_version`, waiting up to `timeout` seconds for that many; None (nothing taken) if there are
        fewer. Older groups are dropped on the way and counted in `dropped_stale`."""
        if type(n_groups) is not int or not 1 <= n_groups <= self.capacity:
            raise ValueError(f"n_groups must be an integer in [1, {self.capacity}] (the capacity), got {n_groups!r}")
        if type(max_staleness) is not int or max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                self._drop_stale(current_version - max_staleness, current_version)
                if len(self._groups) >= n_groups:
                    taken = [self._groups.popleft() for _ in range(n_groups)]
                    self._changed.notify_all()
                    return taken
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(left)

    def __len__(self) -> int:
        with self._changed:
            return len(self._groups)

    def state_dict(self) -> dict:
        """The groups held and the drop count, as JSON types."""
        with self._changed:
            return {"dropped_stale": self.dropped_stale, "groups": [group_state(g) for g in self._groups]}

    def load_state_dict(self, state: dict, bounds: RunBounds, what: str = "the trajectory buffer's state") -> None:
        """Replace the buffer's content by what `state_dict` returned; a bad state (or one past `bounds`) is a
        ValueError naming its entry (`what` and the keys below it), and changes nothing."""
        groups = [group_from_state(item, f"{what}.groups[{i}]", bounds)
                  for i, item in enumerate(entry(state, "groups", list, what))]
        if len(groups) > self.capacity:
            raise ValueError(f"{what} holds {len(groups)} groups, more than this buffer's capacity {self.capacity}")
        dropped = count(state, "dropped_stale", what)
        with self._changed:
            self._groups, self.dropped_stale = deque(groups), dropped
            self._changed.notify_all()

    def _drop_stale(self, oldest_allowed: int, current_version: int) -> None:
        future = [g.index for g in self._groups if g.newest_version > current_version]
        if future:
            raise ValueError(f"groups of prompts {future[:3]} hold tokens of versions newer than the current "
                             f"{current_version}")
        kept = deque(group for group in self._groups if group.oldest_version >= oldest_allowed)
        if len(kept) < len(self._groups):
            self.dropped_stale += len(self._groups) - len(kept)
            self._groups = kept
            self._changed.notify_all()


class PendingGroups:
    """Prompts whose responses are being generated, keyed by the partial rollout's prompt index: `expect` one
    when it starts, `add` finished responses; a group comes out when its `n`-th response arrives."""

    def __init__(self, n: int):
        if type(n) is not int or n < 1:
            raise ValueError(f"n (responses per group) must be an integer >= 1, got {n!r}")
        self.n = n
        self._pending: dict[int, tuple[int, dict, list[Response]]] = {}  # prompt index -> (sampler index, ...)

    def expect(self, prompt_index: int, index: int, prompt: dict) -> None:
        """The prompt of `prompt_index` started, drawn at sampler index `index`, with its row fields."""
        if prompt_index in self._pending:
            raise ValueError(f"prompt {prompt_index} is already pending")
        check_prompt_fields(prompt, f"the prompt fields of prompt {prompt_index}")
        self._pending[prompt_index] = (index, prompt, [])

    def add(self, responses: Sequence[Response]) -> list[Group]:
        """File finished responses under their prompts; returns the groups they completed, in prompt order."""
        unknown = sorted({r.prompt_index for r in responses} - set(self._pending))
        if unknown:
            raise ValueError(f"responses of prompts {unknown[:3]} that were never expected")
        for response in responses:  # each checked before any is filed
            _versions(response)
        for response in responses:
            self._pending[response.prompt_index][2].append(response)
        complete = sorted(k for k, (_, _, done) in self._pending.items() if len(done) >= self.n)
        return [Group(index, prompt, tuple(done)) for index, prompt, done in map(self._pending.pop, complete)]

    def __len__(self) -> int:
        return len(self._pending)

    def state_dict(self) -> dict:
        """The pending prompts and their finished responses, as JSON types."""
        return {"pending": [{"prompt_index": key, "index": index, "prompt": prompt,
                             "responses": [response_state(r) for r in done]}
                            for key, (index, prompt, done) in self._pending.items()]}

    def load_state_dict(self, state: dict, bounds: RunBounds, what: str = "the pending groups' state") -> None:
        """Replace the pending prompts by what `state_dict` returned; a bad state (or one past `bounds`) is a
        ValueError naming its entry (`what` and the keys below it), and changes nothing."""
        pending = {}
        for i, item in enumerate(entry(state, "pending", list, what)):
            where = f"{what}.pending[{i}]"
            key, index = count(item, "prompt_index", where), bounds.index(item, "index", where)
            prompt = check_prompt_fields(entry(item, "prompt", dict, where), f"{where}.prompt")
            done = [response_from_state(r, f"{where}.responses[{j}]", bounds)
                    for j, r in enumerate(entry(item, "responses", list, where))]
            if key in pending or len(done) >= self.n or any(r.prompt_index != key for r in done):
                raise ValueError(f"{where}: prompt {key} is pending twice, has its {self.n} responses already, "
                                 "or holds another prompt's")
            pending[key] = (index, prompt, done)
        self._pending = pending


# --- plain state ----------------------------------------------------------------------------------------

def check_prompt_fields(prompt: Any, what: str) -> dict:
    if not isinstance(prompt, dict):
        raise ValueError(f"{what} must be a dict of the prompt's row fields, got {type(prompt).__name__}")
    return check_plain(prompt, what)


def response_state(response: Response) -> dict:
    """A response of the buffer as JSON types (its episode as a dict)."""
    return {"prompt_index": response.prompt_index, "token_ids": list(response.token_ids),
            "logprobs": None if response.logprobs is None else list(response.logprobs),
            "loss_mask": None if response.loss_mask is None else list(response.loss_mask),
            "token_versions": list(_versions(response)),
            "episode": None if response.episode is None else dataclasses.asdict(response.episode)}


def response_from_state(state: Any, what: str, bounds: RunBounds) -> Response:
    """The response `response_state` saved, every entry checked (against `bounds`)."""
    tokens = bounds.tokens(entry(state, "token_ids", list, what), f"{what}.token_ids", bounds.max_response_tokens)
    versions = bounds.versions(entry(state, "token_versions", list, what), f"{what}.token_versions")
    logprobs, loss_mask = (entry(state, key, (list, type(None)), what) for key in ("logprobs", "loss_mask"))
    logprobs = None if logprobs is None else floats(logprobs, f"{what}.logprobs")
    loss_mask = None if loss_mask is None else ints(loss_mask, f"{what}.loss_mask", low=0, high=1)
    if any(len(values) != len(tokens) for values in (versions, logprobs or tokens, loss_mask or tokens)):
        raise ValueError(f"{what} has {len(tokens)} tokens but other counts of versions, log-probs or loss mask")
    episode = entry(state, "episode", (dict, type(None)), what)
    return Response(count(state, "prompt_index", what), tokens, logprobs, loss_mask,
                    None if episode is None else _episode_from_state(episode, f"{what}.episode"),
                    token_versions=tuple(versions))


def group_state(group: Group) -> dict:
    return {"index": group.index, "prompt": group.prompt, "responses": [response_state(r) for r in group.responses]}


def group_from_state(state: Any, what: str, bounds: RunBounds) -> Group:
    responses = tuple(response_from_state(r, f"{what}.responses[{i}]", bounds)
                      for i, r in enumerate(entry(state, "responses", list, what)))
    return Group(bounds.index(state, "index", what), check_prompt_fields(entry(state, "prompt", dict, what),
                                                                        f"{what}.prompt"), responses)


def _versions(response: Response) -> tuple[int, ...]:
    if response.routed_experts is not None:
        raise ValueError("the trajectory buffer holds no MoE routing: routing replay does not run with "
                         "asynchronous rollouts")
    versions = response.token_versions
    if versions is None or len(versions) != len(response.token_ids):
        raise ValueError(f"a response of prompt {response.prompt_index} carries no weight version per token "
                         "(Response.token_versions)")
    return versions


_EPISODE_LISTS = {"prompt_ids": int, "messages": dict, "tool_calls": dict, "tool_results": dict, "turn_ends": int}


def _episode_from_state(state: dict, what: str) -> EpisodeInfo:
    fields = {}
    for key, kind in _EPISODE_LISTS.items():
        values = entry(state, key, list, what)
        if any(type(value) is not kind for value in values):
            raise ValueError(f"{what}.{key} must be a list of {kind.__name__}")
        fields[key] = check_plain(values, f"{what}.{key}")
    return EpisodeInfo(**fields, truncated=entry(state, "truncated", bool, what))
