"""Partial rollouts on the embedded engine with a tiny Llama: chunked generation against one call, weight changes
between chunks ("finish" and "abort") against fresh forwards of each version's model, a mid-generation state
round trip, the refusals; the batch's `rollout_versions`; and the trainer's schedule of partial rollouts on it
(staleness, versions mixed in flight, resuming from its state, abort)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.models import HFModelConfig
from verl_mega.rollout.engine import SamplingParams
from verl_mega.rollout.partial import PartialRollout, check_partial_config
from verl_mega.rollout.trajectory_buffer import RunBounds
from verl_mega.trainer.rollout_batch import ROLLOUT_VERSIONS, build_rollout_batch

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
MAX_NEW = 12
CHUNK = 5  # not a divisor of MAX_NEW: the last chunk's budget is smaller
# What a saved state may hold here: the tiny models' 300 token ids, the prompts and responses below, versions to 9.
BOUNDS = RunBounds(prompts=6, vocab_size=300, max_prompt_tokens=8, max_response_tokens=MAX_NEW, newest_version=9)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas of the same shapes and different weights (versions 0 and 1), and the tokenizer's EOS."""
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("partial")
    dirs = [make_tiny_hf_model(root / f"v{seed}", "llama", seed=seed) for seed in (0, 1)]
    return dirs, HFModelConfig.read_raw(dirs[0])["eos_token_id"]


@pytest.fixture(scope="module")
def engine(models):
    from verl_mega.rollout.embedded import EmbeddedEngine

    dirs, _ = models
    engine = EmbeddedEngine(HFModelConfig.read_raw(dirs[0]))
    load(engine, dirs[0])
    return engine


@pytest.fixture(scope="module")
def references(models):
    """Each version's model in transformers, for fresh forwards."""
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in models[0]]


def load(engine, hf_dir) -> None:
    reader = SafetensorsReader(hf_dir)
    engine.load_weights((name, reader.read(name)) for name in reader.names())


def run_to_end(rollout: PartialRollout) -> list:
    finished = []
    while rollout.in_flight():
        finished += rollout.step()
    return finished


def by_sample(responses) -> dict:
    """(prompt index, k-th response of that prompt) -> response."""
    seen, out = {}, {}
    for response in responses:
        k = seen[response.prompt_index] = seen.get(response.prompt_index, -1) + 1
        out[response.prompt_index, k] = response
    return out


def forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_chunked_greedy_equals_one_call(engine, models):
    """Chunks re-prefill prompt + tokens so far where one call decodes from its KV cache; greedy picks the same
    tokens (fails if a chunk lost or repeated a token, or mis-counted the remaining budget)."""
    _, eos = models
    engine_params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, n=2, logprobs=True)
    whole = engine.generate(PROMPTS, engine_params)
    rollout = PartialRollout(engine, engine_params, CHUNK, eos_token_ids=[eos])
    assert rollout.start(PROMPTS, version=0) == range(3)
    chunked = by_sample(run_to_end(rollout))
    for row, response in enumerate(whole):
        got = chunked[row // 2, row % 2]
        assert got.token_ids == response.token_ids
        assert got.token_versions == (0,) * len(response.token_ids)
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(response.logprobs), atol=1e-4, rtol=0)


def test_a_stop_token_at_a_chunks_end_finishes_the_sequence(engine, models):
    """A chunk that ends on a stop token at exactly its budget is finished, not continued past the stop."""
    _, eos = models
    greedy = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    tokens = engine.generate([PROMPTS[0]], greedy)[0].token_ids
    # The first token after the first that the response has not had yet: the stop, and the chunk ends on it.
    chunk = next(p for p in range(1, len(tokens)) if tokens[p] not in tokens[:p]) + 1
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=(tokens[chunk - 1],))
    rollout = PartialRollout(engine, params, chunk, eos_token_ids=[eos])
    rollout.start([PROMPTS[0]], version=0)
    assert [r.token_ids for r in rollout.step()] == [tokens[:chunk]] and rollout.in_flight() == 0


def test_prompts_started_between_steps_join_the_next_chunk(engine, models):
    """A prompt started while others are mid-generation gets the next indices and its own full budget (greedy:
    what one call gives it)."""
    _, eos = models
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    whole = engine.generate(PROMPTS, params)
    rollout = PartialRollout(engine, params, CHUNK, eos_token_ids=[eos])
    finished = []
    for index, prompt in enumerate(PROMPTS):
        assert rollout.start([prompt], version=0) == range(index, index + 1)
        finished += rollout.step()
    finished += run_to_end(rollout)
    assert sorted((r.prompt_index, r.token_ids) for r in finished) == [(i, r.token_ids) for i, r in enumerate(whole)]


def test_an_engine_failing_mid_step_leaves_the_rollout_as_it_was(engine, models):
    """The step's second call fails (a prompt id outside the vocabulary) after its first succeeded: no sequence
    took the first call's tokens, so the state is the one before the step."""
    _, eos = models
    rollout = PartialRollout(engine, SamplingParams(temperature=0, max_new_tokens=MAX_NEW), CHUNK,
                             eos_token_ids=[eos])
    rollout.start([PROMPTS[0]], version=0)
    rollout.step()
    rollout.step()  # 10 tokens: its next call asks for 2, the new prompt's for 5
    assert rollout.in_flight() == 1
    rollout.start([[5, 10**6]], version=0)
    before = rollout.state_dict()
    with pytest.raises(IndexError):
        rollout.step()
    assert rollout.state_dict() == before


def test_sampling_is_reproducible_for_a_seed_and_the_samples_of_a_prompt_differ(engine, models):
    """The same seed and chunk size give the same responses; another seed others; and the two samples of a
    prompt differ (tests/workers/vllm_worker.py checks the same on vLLM, whose requests of a call are seeded alike)."""
    _, eos = models

    def sample(seed: int) -> dict:
        rollout = PartialRollout(engine, SamplingParams(max_new_tokens=MAX_NEW, n=2, seed=seed), CHUNK,
                                 eos_token_ids=[eos])
        rollout.start(PROMPTS, version=0)
        return {key: r.token_ids for key, r in by_sample(run_to_end(rollout)).items()}

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first
    assert all(first[index, 0] != first[index, 1] for index in range(len(PROMPTS)))


def test_prompts_started_with_a_seed_of_their_own_are_one_plain_call_in_a_whole_budget_chunk(engine, models):
    """A round started with its slot's seed (the trainer's) and a chunk of the whole budget is one `generate`
    call of its prompts with that seed: the same tokens and log-probs, bit for bit (what makes async partial
    rollouts at max_staleness 0 equal sync). Two rounds started with two seeds are two calls. Could fail if the
    start seed were ignored, or the rounds merged into one call."""
    _, eos = models
    params = SamplingParams(max_new_tokens=MAX_NEW, n=2, seed=3, logprobs=True)
    rollout = PartialRollout(engine, params, MAX_NEW, eos_token_ids=[eos])
    rollout.start(PROMPTS[:2], version=0, seed=11)
    rollout.start(PROMPTS[2:], version=0, seed=12)
    got = run_to_end(rollout)
    plain = [*engine.generate(PROMPTS[:2], dataclasses.replace(params, seed=11)),
             *[dataclasses.replace(r, prompt_index=2) for r in engine.generate(PROMPTS[2:],
                                                                             dataclasses.replace(params, seed=12))]]
    assert [(r.prompt_index, r.token_ids, r.logprobs) for r in got] == [
        (r.prompt_index, r.token_ids, r.logprobs) for r in plain]
    assert all(set(r.token_versions) == {0} for r in got)


def test_finish_keeps_the_version_and_log_prob_of_the_policy_that_sampled_each_token(engine, models, references):
    """Version 0 samples the first chunk, version 1 the rest; each token's log-prob is its model's (a fresh full
    forward of that version over prompt + tokens). Fails if the update re-tagged old tokens, or if a chunk's
    log-probs came from the wrong weights."""
    dirs, eos = models
    rollout = PartialRollout(engine, SamplingParams(max_new_tokens=MAX_NEW, n=2, seed=3, logprobs=True), CHUNK,
                             eos_token_ids=[eos])
    rollout.start(PROMPTS, version=0)
    try:
        early = rollout.step()
        load(engine, dirs[1])
        rollout.update_weights(1, "finish")
        finished = early + run_to_end(rollout)
    finally:
        load(engine, dirs[0])
    assert len(finished) == 6
    assert any(1 in r.token_versions for r in finished), "every sequence stopped in the first chunk"
    for response in finished:
        versions = torch.tensor(response.token_versions)
        first = min(CHUNK, len(response.token_ids))
        assert versions[:first].tolist() == [0] * first and versions[first:].tolist() == [1] * (len(versions) - first)
        prompt = PROMPTS[response.prompt_index]
        want = torch.where(versions == 0, forward_logprobs(references[0], prompt, response.token_ids),
                           forward_logprobs(references[1], prompt, response.token_ids))
        torch.testing.assert_close(torch.tensor(response.logprobs), want, atol=1e-4, rtol=0)


def test_abort_restarts_in_flight_sequences_under_the_new_weights(engine, models, references):
    """After "abort", an in-flight sequence is what the new weights generate from its prompt (greedy: one call of
    version 1), every token of version 1 with version 1's log-prob; one finished before the update keeps version
    0. Fails if aborted tokens were kept, or counted wrong."""
    dirs, eos = models
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, logprobs=True)
    rollout = PartialRollout(engine, params, CHUNK, eos_token_ids=[eos])
    rollout.start(PROMPTS, version=0)
    try:
        early = rollout.step()
        in_flight = rollout.in_flight()
        load(engine, dirs[1])
        rollout.update_weights(1, "abort")
        later = run_to_end(rollout)
        fresh = engine.generate(PROMPTS, params)
    finally:
        load(engine, dirs[0])
    assert rollout.discarded_tokens == CHUNK * in_flight > 0
    assert all(set(r.token_versions) == {0} for r in early)
    for response in later:
        assert response.token_ids == fresh[response.prompt_index].token_ids
        assert set(response.token_versions) == {1}
        want = forward_logprobs(references[1], PROMPTS[response.prompt_index], response.token_ids)
        torch.testing.assert_close(torch.tensor(response.logprobs), want, atol=1e-4, rtol=0)


def test_a_state_saved_mid_generation_resumes_the_same_responses(engine, models):
    """A state taken between chunks (through JSON, as a job state is saved) and loaded into a new rollout
    finishes with the responses of the uninterrupted one, token for token and log-prob for log-prob."""
    _, eos = models
    params = SamplingParams(max_new_tokens=MAX_NEW, n=2, seed=5, logprobs=True)

    def fresh() -> PartialRollout:
        return PartialRollout(engine, params, CHUNK, eos_token_ids=[eos])

    whole = fresh()
    whole.start(PROMPTS, version=0)
    whole.step()
    saved = json.loads(json.dumps(whole.state_dict()))
    assert saved["sequences"] and whole.in_flight() == len(saved["sequences"])
    resumed = fresh()
    resumed.load_state_dict(saved, BOUNDS)
    assert resumed.state_dict() == saved
    assert run_to_end(resumed) == run_to_end(whole)


@pytest.mark.parametrize("spoil, named", [
    (lambda s: s.update(chunk_tokens=CHUNK + 1), "chunk_tokens=6"),
    (lambda s: s["params"].update(seed=6), "other sampling params"),
    (lambda s: s["sequences"][0].update(versions=[9] * len(s["sequences"][0]["tokens"])), "versions holds values"),
    (lambda s: s["sequences"][0].update(logprobs=[]), "log-probs"),
    (lambda s: s["sequences"][0].update(tokens="1, 2"), "tokens is str"),
    (lambda s: s["sequences"][0].update(sample=2), "sample 2 of prompt"),
    (lambda s: s.pop("rounds"), "has no 'rounds'"),
])
def test_a_bad_state_is_refused_naming_it_and_changes_nothing(engine, models, spoil, named):
    _, eos = models
    params = SamplingParams(max_new_tokens=MAX_NEW, n=2, seed=5, logprobs=True)
    source = PartialRollout(engine, params, CHUNK, eos_token_ids=[eos])
    source.start(PROMPTS, version=0)
    source.step()
    state = json.loads(json.dumps(source.state_dict()))
    spoil(state)
    target = PartialRollout(engine, params, CHUNK, eos_token_ids=[eos])
    before = target.state_dict()
    with pytest.raises(ValueError, match=named):
        target.load_state_dict(state, BOUNDS)
    assert target.state_dict() == before


def test_weight_versions_only_move_forward_and_the_policy_is_named(engine, models):
    _, eos = models
    rollout = PartialRollout(engine, SamplingParams(max_new_tokens=4), CHUNK, eos_token_ids=[eos])
    rollout.start(PROMPTS, version=2)
    with pytest.raises(ValueError, match="newer than the last one, 2"):
        rollout.update_weights(2, "finish")
    with pytest.raises(ValueError, match="policy must be one of"):
        rollout.update_weights(3, "resume")
    with pytest.raises(ValueError, match="call update_weights first"):
        rollout.start(PROMPTS, version=3)
    with pytest.raises(ValueError, match="routing"):
        PartialRollout(engine, SamplingParams(routed_experts=True), CHUNK, eos_token_ids=[eos])


def test_partial_rollouts_of_multi_turn_episodes_are_refused_in_one_line():
    problems = []
    check_partial_config("finish", 0, True, lambda ok, problem: ok or problems.append(problem))
    assert problems == ["rollout.partial_chunk_tokens must be >= 1, got 0",
                        "rollout.partial=finish with rollout.multi_turn.enable: partial rollouts resume single-turn "
                        "generations only; set rollout.partial=off or turn multi-turn off"]


def test_the_batch_keeps_each_tokens_version_padded_with_minus_one():
    batch = build_rollout_batch([[5, 6], [7]], [[1, 2, 3], [4]], 2, 0, token_versions=[(3, 4, 4), (2,)])
    assert batch[ROLLOUT_VERSIONS].tolist() == [[3, 4], [2, -1]]
    assert ROLLOUT_VERSIONS not in build_rollout_batch([[5]], [[1]], 2, 0, token_versions=[None])
    with pytest.raises(ValueError, match="all or none"):
        build_rollout_batch([[5], [6]], [[1], [2]], 2, 0, token_versions=[(1,), None])
    with pytest.raises(ValueError, match="2 tokens came with 1 token versions"):
        build_rollout_batch([[5]], [[1, 2]], 2, 0, token_versions=[(1,)])


# --- the trainer's schedule of partial rollouts (colocated, one process) ------------------------------------

def partial_schedule(engine, eos: int, staleness: int, policy: str):
    """PartialSchedule over LocalChunks on the tiny engine: rounds of 2 prompts (drawn by round number, as a
    sampler's position would), 2 samples each, one-token chunks."""
    from verl_mega.parallel.layout import rollout_coordinates
    from verl_mega.trainer.rl.partial_schedule import LocalChunks, PartialSchedule

    params = SamplingParams(max_new_tokens=4, n=2, seed=5, logprobs=True)
    chunks = LocalChunks(engine, params, 1, policy, [eos], rollout_coordinates(0, 1, 1, 1), 1)

    def draw():
        first = 2 * schedule.next_step
        indices = [first % 6, (first + 1) % 6]
        return indices, [[5 + index, 6 + index, 7] for index in indices]

    schedule = PartialSchedule(staleness, 2, 2, chunks, draw, lambda step, gen_round: [1000 + step])
    return schedule


def trained_groups(schedule, steps: range) -> list[list[tuple]]:
    """What each step trains on (the weights' version is the step): per group, its prompt and each response's
    tokens, versions and log-probs."""
    from verl_mega.trainer.metrics import StageTimer

    trained = []
    for version in steps:
        timer = StageTimer()
        schedule.fill(timer, version)
        taken = schedule.take(version, 0, timer, version)
        schedule.ahead(timer, version)
        schedule.settle()
        responses = [(r.token_ids, r.token_versions, r.logprobs) for r in taken.responses]
        trained.append([(index, *responses[2 * i:2 * i + 2]) for i, index in enumerate(taken.indices)])
    return trained


def test_the_partial_schedule_keeps_staleness_bounded_and_mixes_versions_in_flight(engine, models, one_rank_world):
    """At max_staleness 1 with one-token chunks, rounds start a chunk apart, so some group a step trains on holds
    tokens of two versions; none is older than one version or from the future. Could fail if chunks were not
    taken between weight versions, or stale groups were trained on."""
    _, eos = models
    trained = trained_groups(partial_schedule(engine, eos, 1, "finish"), range(5))
    for step, groups in enumerate(trained):
        versions = [v for group in groups for tokens, token_versions, _ in group[1:] for v in token_versions]
        assert step - 1 <= min(versions) and max(versions) <= step
    assert any(len({v for _, token_versions, _ in group[1:] for v in token_versions}) == 2
               for groups in trained for group in groups)


def test_the_partial_schedule_resumes_from_its_state_with_sequences_in_flight(engine, models, one_rank_world):
    """Saved after step 2 (sequences in flight) and loaded into a fresh schedule, it trains steps 3-4 on what the
    uninterrupted one did, tokens, versions and log-probs. Could fail if the partial rollout, the pending groups
    or the buffer were not in the state."""
    _, eos = models
    straight = trained_groups(partial_schedule(engine, eos, 1, "finish"), range(4))
    first = partial_schedule(engine, eos, 1, "finish")
    trained_groups(first, range(2))
    state = json.loads(json.dumps(first.state_dict()))
    assert any(sequence["tokens"] for sequence in state["rollouts"][0]["sequences"])
    resumed = partial_schedule(engine, eos, 1, "finish")
    resumed.load_state_dict(state, BOUNDS)
    assert trained_groups(resumed, range(2, 4)) == straight[2:]


def test_abort_in_the_partial_schedule_trains_on_one_version_per_response(engine, models, one_rank_world):
    """With abort, sequences in flight when a version arrives start again: every response is one version's, and
    tokens were dropped. Could fail if the policy did not reach the chunks' partial rollout."""
    _, eos = models
    schedule = partial_schedule(engine, eos, 1, "abort")
    trained = trained_groups(schedule, range(4))
    assert all(len(set(token_versions)) == 1 for groups in trained for group in groups
               for _, token_versions, _ in group[1:])
    assert schedule.chunks.partial.discarded_tokens > 0
