"""Partial rollouts: generation in chunks, so that new weights can arrive while sequences are in flight.

`PartialRollout` drives any `RolloutEngine` through its plain `generate`: each `step` asks the engine for at most
`chunk_tokens` more tokens of every in-flight sequence, fed its prompt plus the tokens it has so far, with what
is left of the sampling budget. Between steps the caller may load new weights into the engine and call
`update_weights(version, policy)`:
- "finish": in-flight sequences go on under the new weights; each token keeps the version and the log-prob of
  the policy that sampled it (`Response.token_versions`, `Response.logprobs`), which is what the off-policy
  correction needs.
- "abort": in-flight sequences drop their tokens and start again from the prompt under the new weights
  (`discarded_tokens` counts what was dropped).
Everything a run needs to go on exactly is plain data (`state_dict`), so a checkpoint taken mid-generation
resumes with the same responses.

Calls and seeds. `generate` takes one seed per call, and vLLM seeds every request of a call alike, so two
in-flight samples of one prompt sent as two requests of one call would draw the same numbers (and from the prompt
alone, the same tokens). A prompt whose `n` samples all start from it (nothing generated yet) therefore goes into
one call with the engine's own `n`, which prefills it once and keeps its samples apart; a sample that has tokens
goes into one call per sample slot (the j-th sample of every such prompt) and remaining budget. Each call is
seeded by a hash of (`params.seed`, the step's round, the slot, the budget), so a run is reproducible for a fixed
seed and chunk size (not to one `generate` call's samples, whose calls and seeds differ), except the first chunk of
prompts started with a seed of their own (`start(..., seed=)`): one call per such seed, seeded by it, so that with
a chunk as long as `max_new_tokens` a round started so is exactly one plain `generate` call of it. Chunk boundaries
change a sequence only as re-prefilling does (the prompt and the tokens so far run through the model again,
where one call would have used its KV cache): with greedy decoding and unchanged weights, chunked equals
unchunked token for token on the embedded engine.

Multi-turn episodes are not resumed here (`check_partial_config` refuses them), nor is MoE routing recorded.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

from verl_mega.files.plain_state import count, entry, floats, ints

from .engine import Response, RolloutEngine, SamplingParams
from .trajectory_buffer import RunBounds

POLICIES = ("finish", "abort")  # what in-flight sequences do when new weights arrive
SEED_RANGE = 2**31  # derived seeds stay below it: vLLM and torch take any int of that size
FRESH = -1  # the slot of a call that starts prompts' n samples together, with the engine's own n


def check_partial_config(partial: str, chunk_tokens: int, multi_turn: bool, need: Callable[[bool, str], None]
                         ) -> None:
    """need(ok, problem) for each reason `rollout.partial` cannot run as configured (the pre-flight check's):
    one line naming the key and the fix."""
    need(chunk_tokens >= 1, f"rollout.partial_chunk_tokens must be >= 1, got {chunk_tokens}")
    need(not multi_turn, f"rollout.partial={partial} with rollout.multi_turn.enable: partial rollouts resume "
                         "single-turn generations only; set rollout.partial=off or turn multi-turn off")


@dataclass
class _Sequence:
    """One in-flight sample: its prompt and what it has generated so far, one version per token."""

    prompt_index: int
    sample: int  # its slot among the prompt's `params.n` samples
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    seed: int | None = None  # of its first chunk, as `start` was given it; None: derived like the others'

    def restart(self) -> int:
        """Drop what it generated; returns how many tokens that was. Its new first chunk is seeded as the
        others are (its own seed drew the dropped tokens)."""
        dropped = len(self.tokens)
        self.tokens, self.logprobs, self.versions, self.seed = [], [], [], None
        return dropped


class PartialRollout:
    """Chunked, resumable generation of `params.n` samples per prompt on `engine` (see the module docstring).

    `eos_token_ids`: the ids the engine stops at by itself (the model's EOS); with `params.stop_token_ids` they
    tell a chunk that ended on a stop token at exactly its budget from one that ran out of budget.
    Call `update_weights` after the engine holds the new weights; `step` until `in_flight()` is 0 (or go on
    starting prompts: `start` may be called between steps)."""

    def __init__(self, engine: RolloutEngine, params: SamplingParams, chunk_tokens: int, *,
                 eos_token_ids: Sequence[int]):
        if type(chunk_tokens) is not int or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
        if params.routed_experts:
            raise ValueError("a partial rollout records no MoE routing: SamplingParams.routed_experts must be off")
        self.engine, self.params, self.chunk_tokens = engine, params, chunk_tokens
        self.stop_ids = set(params.stop_token_ids) | set(eos_token_ids)
        self.version = 0
        self.rounds = 0  # steps taken: the seed of each step's calls
        self.started = 0  # prompts started: the next prompt's index
        self.discarded_tokens = 0  # tokens dropped by "abort"
        self._sequences: list[_Sequence] = []

    def start(self, prompts: Sequence[Sequence[int]], version: int, seed: int | None = None) -> range:
        """Put `params.n` samples of each prompt in flight, sampled from `version`'s weights (the engine's now:
        the version in-flight sequences have, if any); `seed`: their first chunk's (one call of these prompts),
        else derived. Returns the prompts' indices, which their responses' `prompt_index` holds: they count every
        prompt started on this rollout, from 0."""
        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("a partial rollout cannot start from an empty prompt")
        if seed is not None and type(seed) is not int:
            raise ValueError(f"a start seed must be an integer, got {seed!r}")
        if self._sequences and version != self.version:
            raise ValueError(f"start at version {version} with sequences in flight at {self.version}: "
                             "call update_weights first")
        self._check_version(version, allow_same=True)
        self.version = version
        indices = range(self.started, self.started + len(prompts))
        self._sequences += [_Sequence(index, sample, list(prompt), seed=seed)
                            for index, prompt in zip(indices, prompts) for sample in range(self.params.n)]
        self.started += len(prompts)
        return indices

    def step(self) -> list[Response]:
        """One chunk for every in-flight sequence; returns the sequences that finished (a stop token, or the
        whole `max_new_tokens`), ordered by prompt and sample."""
        calls = self._calls()
        # Every call first, then the sequences: an engine that fails mid-step leaves the rollout as it was.
        # Sequences under way go first, then the prompts that start.
        order = sorted(calls, key=lambda call: (call[0] == FRESH, call[:2], call[2] is not None, call[2] or 0))
        results = [(calls[key], key[1], self._generate(calls[key], *key)) for key in order]
        finished = []
        for sequences, budget, chunks in results:
            for sequence, chunk in zip(sequences, chunks):
                self._extend(sequence, chunk)
                if self._finished(sequence, len(chunk.token_ids) < budget):
                    finished.append(sequence)
        self.rounds += 1
        done = {id(sequence) for sequence in finished}
        self._sequences = [s for s in self._sequences if id(s) not in done]
        return [self._response(s) for s in sorted(finished, key=lambda s: (s.prompt_index, s.sample))]

    def update_weights(self, version: int, policy: str) -> None:
        """The engine now holds `version`'s weights (newer than the last): in-flight sequences "finish" under
        them, or "abort" and start again from their prompts."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self._check_version(version, allow_same=False)
        self.version = version
        if policy == "abort":
            self.discarded_tokens += sum(sequence.restart() for sequence in self._sequences)

    def in_flight(self) -> int:
        """How many sequences are generating."""
        return len(self._sequences)

    def state_dict(self) -> dict:
        """Everything `load_state_dict` needs to go on exactly, as JSON types (a job state's)."""
        return {"chunk_tokens": self.chunk_tokens, "params": _params_state(self.params), "version": self.version,
                "rounds": self.rounds, "started": self.started, "discarded_tokens": self.discarded_tokens,
                "sequences": [dataclasses.asdict(sequence) for sequence in self._sequences]}

    def load_state_dict(self, state: dict, bounds: RunBounds, what: str = "the partial rollout's state") -> None:
        """Take back what `state_dict` returned, made with the same sampling params and chunk size; a state
        that is not one, or goes past `bounds` (prompts longer, token ids or a version beyond this run's), is a
        ValueError naming the bad entry (`what` and the keys below it), and changes nothing."""
        if entry(state, "chunk_tokens", int, what) != self.chunk_tokens:
            raise ValueError(f"{what} was saved with chunk_tokens={state['chunk_tokens']}, this rollout has "
                             f"{self.chunk_tokens}: it would not resume the same sequences")
        if entry(state, "params", dict, what) != _params_state(self.params):
            raise ValueError(f"{what} was saved with other sampling params: it would not resume the same "
                             "sequences")
        version = count(state, "version", what, high=bounds.newest_version, note=" (the checkpoint's step)")
        started = count(state, "started", what)
        sequences = [self._sequence_from(item, f"{what}.sequences[{i}]", version, started, bounds)
                     for i, item in enumerate(entry(state, "sequences", list, what))]
        self.rounds, self.discarded_tokens = count(state, "rounds", what), count(state, "discarded_tokens", what)
        self.version, self.started, self._sequences = version, started, sequences

    # --- one chunk --------------------------------------------------------------------------------------

    def _budget(self, sequence: _Sequence) -> int:
        return min(self.chunk_tokens, self.params.max_new_tokens - len(sequence.tokens))

    def _calls(self) -> dict[tuple[int, int, int | None], list[_Sequence]]:
        """(slot, budget, start seed) -> the sequences of one engine call: prompts whose n samples all start now
        (slot FRESH, n per prompt, in sample order, by the seed `start` was given), the others by sample slot (see
        the module docstring)."""
        by_prompt: dict[int, list[_Sequence]] = {}
        for sequence in self._sequences:
            by_prompt.setdefault(sequence.prompt_index, []).append(sequence)
        calls: dict[tuple[int, int], list[_Sequence]] = {}
        for sequences in by_prompt.values():
            if len(sequences) == self.params.n and not any(s.tokens for s in sequences):
                calls.setdefault((FRESH, self._budget(sequences[0]), sequences[0].seed), []).extend(
                    sorted(sequences, key=lambda s: s.sample))
            else:
                for sequence in sequences:
                    calls.setdefault((sequence.sample, self._budget(sequence), None), []).append(sequence)
        return calls

    def _generate(self, sequences: list[_Sequence], slot: int, budget: int, start_seed: int | None
                  ) -> list[Response]:
        """One call: at most `budget` more tokens of each of `sequences` (one request each, or one per prompt
        with the engine's n when `slot` is FRESH), seeded by `start_seed` where they were started with one."""
        samples = self.params.n if slot == FRESH else 1
        seed = start_seed
        if seed is None and self.params.seed is not None:
            seed = derived_seed(self.params.seed, self.rounds, slot, budget)
        params = dataclasses.replace(self.params, n=samples, max_new_tokens=budget, seed=seed)
        chunks = self.engine.generate([s.prompt + s.tokens for s in sequences[::samples]], params)
        if len(chunks) != len(sequences) or any(len(chunk.token_ids) > budget for chunk in chunks):
            raise RuntimeError(f"the engine returned {len(chunks)} responses where {len(sequences)} were asked "
                               f"for, or more than the {budget} tokens asked for")
        if self.params.logprobs and any(c.logprobs is None or len(c.logprobs) != len(c.token_ids) for c in chunks):
            raise RuntimeError("the engine returned no log-prob for every token, though asked to")
        return chunks

    def _extend(self, sequence: _Sequence, chunk: Response) -> None:
        sequence.tokens += chunk.token_ids
        sequence.seed = None  # its first chunk is done
        sequence.versions += [self.version] * len(chunk.token_ids)
        if self.params.logprobs:
            sequence.logprobs += chunk.logprobs

    def _finished(self, sequence: _Sequence, stopped_early: bool) -> bool:
        """Whether the engine stopped it (short of the chunk's budget, or on a stop token at its end) or it has
        its whole budget."""
        return (stopped_early or len(sequence.tokens) >= self.params.max_new_tokens
                or sequence.tokens[-1] in self.stop_ids)

    def _response(self, sequence: _Sequence) -> Response:
        return Response(sequence.prompt_index, sequence.tokens, sequence.logprobs if self.params.logprobs else None,
                        token_versions=tuple(sequence.versions))

    def _check_version(self, version: int, allow_same: bool) -> None:
        if type(version) is not int or version < self.version or (version == self.version and not allow_same):
            newer = "newer than" if not allow_same else "at least"
            raise ValueError(f"weight version {version!r} must be an integer {newer} the last one, {self.version}")

    def _sequence_from(self, item, what: str, version: int, started: int, bounds: RunBounds) -> _Sequence:
        """A saved sequence, checked against these params (`started` prompts, versions up to `version`) and
        `bounds` (the prompt's length, the vocabulary)."""
        prompt_index, sample = count(item, "prompt_index", what), count(item, "sample", what)
        if prompt_index >= started or sample >= self.params.n:
            raise ValueError(f"{what} is sample {sample} of prompt {prompt_index}; the state started {started} "
                             f"prompts of {self.params.n} samples")
        prompt = bounds.tokens(entry(item, "prompt", list, what), f"{what}.prompt", bounds.max_prompt_tokens)
        tokens = bounds.tokens(entry(item, "tokens", list, what), f"{what}.tokens", self.params.max_new_tokens)
        versions = ints(entry(item, "versions", list, what), f"{what}.versions", low=0, high=version)
        logprobs = floats(entry(item, "logprobs", list, what), f"{what}.logprobs")
        seed = entry(item, "seed", (int, type(None)), what)
        if seed is not None and tokens:
            raise ValueError(f"{what} has tokens and still a start seed: its first chunk is done")
        if not prompt or len(tokens) >= self.params.max_new_tokens:
            raise ValueError(f"{what} has an empty prompt or its whole budget of tokens: it is not in flight")
        if len(versions) != len(tokens) or len(logprobs) != (len(tokens) if self.params.logprobs else 0):
            raise ValueError(f"{what} has {len(tokens)} tokens but {len(versions)} versions and {len(logprobs)} "
                             "log-probs")
        return _Sequence(prompt_index, sample, prompt, tokens, logprobs, versions, seed)


def derived_seed(seed: int, round_: int, sample: int, budget: int) -> int:
    """The seed of one chunk call: a hash of what identifies the call, the same in every process."""
    digest = hashlib.blake2b(repr((seed, round_, sample, budget)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_RANGE


def _params_state(params: SamplingParams) -> dict:
    """The sampling params as JSON types (tuples as lists, as they come back from JSON)."""
    return {key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(params).items()}
