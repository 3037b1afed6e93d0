"""The rollout schedule (rollout.mode): which generated round a step trains on, the weight version it lags by,
its checkpointed buffer, and the pre-flight refusals of the mode's keys."""
import json

import pytest

from verl_mega.config import ConfigError, load_config
from verl_mega.rollout.engine import Response
from verl_mega.rollout.trajectory_buffer import RunBounds
from verl_mega.trainer.preflight import preflight_check
from verl_mega.trainer.metrics import StageTimer
from verl_mega.trainer.rl.schedule import GeneratedRound, Pending, RolloutSchedule

N = 2  # responses per prompt
BATCH = 2  # prompts per round
TIMER = StageTimer()  # the step's stage timer, handed on to the generation
# What a saved schedule may hold here: 100 prompts, the rounds' token ids and lengths, versions up to 9.
BOUNDS = RunBounds(prompts=100, vocab_size=64, max_prompt_tokens=8, max_response_tokens=8, newest_version=9)


class Generation:
    """The trainer's side of generation, without an engine: a round per slot asked for, its prompt indices and
    responses named by the slot (step, round), so a test tells which generation a step trains on."""

    def __init__(self, remote: bool = False):
        self.slots, self.awaited, self.remote = [], [], remote

    def __call__(self, timer, step: int, gen_round: int) -> Pending:
        self.slots.append((step, gen_round))
        indices = [10 * step + gen_round + prompt for prompt in range(BATCH)]
        responses = [Response(p, [step, gen_round, k], [-0.1 * step - 1 / 3, -0.5, -1.0]) for p in range(BATCH)
                     for k in range(N)]
        generated = GeneratedRound(indices, responses, greedy=[Response(p, [step, p]) for p in range(BATCH)])
        if not self.remote:
            return Pending.done(generated)
        return Pending(lambda: self.awaited.append((step, gen_round)) or generated)


def schedule_for(mode: str, staleness: int = 1, generate: Generation | None = None) -> RolloutSchedule:
    return RolloutSchedule(mode, staleness, BATCH, N, generate or Generation())


def trained_rounds(mode: str, staleness: int, steps: int, rounds_per_step=lambda step: 1):
    """For each round the `steps` steps train on: (its generation slot, its weight version, the step); the weights
    advance one version a step. And every slot generated."""
    generate = Generation()
    schedule = schedule_for(mode, staleness, generate=generate)
    trained = []
    for step in range(steps):
        schedule.fill(TIMER, version=step)
        for gen_round in range(rounds_per_step(step)):
            taken = schedule.take(step, gen_round, TIMER, version=step)
            slot = tuple(taken.responses[0].token_ids[:2])
            versions = {v for r in taken.responses for v in (r.token_versions or (step,))}
            assert len(versions) == 1 and len(taken.indices) == BATCH and len(taken.responses) == BATCH * N
            trained.append((slot, versions.pop(), step))
    return trained, generate.slots


def test_sync_and_async_at_staleness_0_train_each_step_on_its_own_fresh_round():
    """Could fail if async kept a round ahead at staleness 0 (it must be sync, bitwise: the same slots, so the
    same seeds and sampler draws, in the same order)."""
    for mode in ("sync", "async"):
        trained, generated = trained_rounds(mode, 0, 4)
        assert trained == [((step, 0), step, step) for step in range(4)]
        assert generated == [(step, 0) for step in range(4)]


def test_sync_tags_no_versions_so_its_batch_is_todays():
    taken = schedule_for("sync").take(0, 0, TIMER, version=0)
    assert all(response.token_versions is None for response in taken.responses)


def test_one_step_off_trains_on_the_round_of_the_weights_one_version_older():
    """The first step generates two rounds; step k trains on the round generated before step k-1's update.
    Could fail if a step generated after taking, or took the newest round."""
    trained, generated = trained_rounds("one_step_off", 0, 4)
    assert generated[:2] == [(0, 0), (1, 0)] and len(generated) == 5
    assert [(slot, version) for slot, version, _ in trained] == [((0, 0), 0), ((1, 0), 0), ((2, 0), 1), ((3, 0), 2)]
    assert trained_rounds("async", 1, 4) == (trained, generated)  # one step off is async at staleness 1


def test_async_never_trains_on_data_older_than_max_staleness():
    trained, _ = trained_rounds("async", 2, 6)
    assert [step - version for _, version, step in trained] == [0, 1, 2, 2, 2, 2]


def test_dynamic_sampling_rounds_take_the_buffer_then_generate_in_their_own_slots():
    """A step's later rounds use what is left ahead, then generate fresh in slot (step, round >= 1), which no
    round ahead (slot (step', 0)) can collide with. Could fail if two generations shared a seed slot."""
    trained, generated = trained_rounds("one_step_off", 0, 3, rounds_per_step=lambda step: 3 if step == 1 else 1)
    assert [slot for slot, _, step in trained if step == 1] == [(1, 0), (2, 0), (1, 2)]
    assert len(set(generated)) == len(generated)


def test_a_round_requested_ahead_is_awaited_only_when_the_step_settles():
    """Rollout ranks of their own: in one_step_off, step k requests round k + 1 before it takes round k and
    waits for it only when it settles (after its update), so generation overlaps training. Could fail if take
    or fill waited for a round the step does not train on."""
    generate = Generation(remote=True)
    schedule = schedule_for("one_step_off", generate=generate)
    schedule.fill(TIMER, version=0)
    assert generate.slots == [(0, 0), (1, 0)] and not generate.awaited
    schedule.take(0, 0, TIMER, version=0)
    assert generate.awaited == [(0, 0)] and len(schedule.in_flight) == 1
    schedule.settle()
    assert generate.awaited == [(0, 0), (1, 0)] and not schedule.in_flight
    schedule.fill(TIMER, version=1)
    taken = schedule.take(1, 0, TIMER, version=1)
    assert generate.awaited == [(0, 0), (1, 0)] and taken.indices == [10, 11]
    assert {v for r in taken.responses for v in r.token_versions} == {0}


def test_remax_greedy_responses_travel_with_their_groups():
    schedule = schedule_for("one_step_off")
    schedule.fill(TIMER, version=0)
    schedule.take(0, 0, TIMER, version=0)
    taken = schedule.take(1, 0, TIMER, version=1)
    assert [r.token_ids for r in taken.greedy] == [[1, 0], [1, 1]] and taken.indices == [10, 11]


def test_the_buffer_survives_a_checkpoint_as_json_exactly():
    """Could fail if the state lost a log-prob's last bit, a version, or the next slot."""
    generate = Generation()
    schedule = schedule_for("async", 2, generate=generate)
    schedule.fill(TIMER, version=0)
    schedule.take(0, 0, TIMER, version=0)
    schedule.settle()
    resumed = schedule_for("async", 2, generate=generate)
    resumed.load_state_dict(json.loads(json.dumps(schedule.state_dict())), bounds=BOUNDS)
    assert resumed.next_step == 3 and len(resumed.buffer) == 2 * BATCH
    for step in (1, 2):
        before, after = (s.take(step, 0, TIMER, version=1) for s in (schedule, resumed))
        assert after == before  # indices, tokens, log-probs and versions, bit for bit


@pytest.mark.parametrize("edit, words", [
    (lambda state: state["buffer"]["groups"][0].update(index=100), "index=100 must be in [0, 99] (data.train_files hold 100 prompts)"),
    (lambda state: state.pop("next_step"), "has no 'next_step'"),
    (lambda state: state.update(buffer=None), "does not belong to this rollout.mode"),
    (lambda state: state["buffer"]["groups"][0]["responses"][0].update(token_ids=[1]), "other counts of versions"),
])
def test_a_tampered_buffer_is_refused_in_one_line(edit, words):
    schedule = schedule_for("one_step_off")
    schedule.fill(TIMER, version=0)
    schedule.settle()
    state = json.loads(json.dumps(schedule.state_dict()))
    edit(state)
    with pytest.raises(ValueError, match=r"^rollout_schedule[. ]") as err:
        schedule_for("one_step_off").load_state_dict(state, bounds=BOUNDS)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.mode=later"], "rollout.mode 'later' is unknown; known: sync, one_step_off, async"),
    (["rollout.mode=async", "rollout.max_staleness=-1"], "rollout.max_staleness must be >= 0"),
    (["rollout.mode=async", "rollout.partial=maybe"], "rollout.partial 'maybe' is unknown; known: off, finish"),
    (["rollout.mode=async", "rollout.partial_chunk_tokens=0"], "rollout.partial_chunk_tokens must be >= 1"),
    (["rollout.max_staleness=3"], "rollout.max_staleness=3 applies to rollout.mode=async only (this run's is sync)"),
    (["rollout.mode=one_step_off", "rollout.partial=abort"], "rollout.partial=abort applies to rollout.mode=async"),
    (["rollout.mode=async", "rollout.partial=finish", "algorithm.adv_estimator=remax"],
     "rollout.partial=finish with algorithm.adv_estimator=remax: its greedy baseline"),
    (["rollout.mode=async", "rollout.partial=abort", "rollout.multi_turn.enable=true",
      "rollout.multi_turn.tools=[calculator]"], "rollout.mode=async with rollout.multi_turn.enable"),
    (["rollout.mode=one_step_off", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"],
     "rollout.mode=one_step_off with rollout.multi_turn.enable"),
    (["rollout.mode=one_step_off", "actor.router_replay=rollout"],
     "rollout.mode=one_step_off with actor.router_replay=rollout"),
    (["job=sft", "rollout.mode=async"], "rollout.mode=async: job sft generates nothing"),
])
def test_mode_settings_that_cannot_work_are_refused_naming_the_key(tiny_models, prompt_file, overrides, message):
    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]",
                                "data.batch_size=4", "actor.mini_batch_size=4", "critic.mini_batch_size=4",
                                *overrides])
    with pytest.raises(ConfigError) as err:
        preflight_check(config, world_size=1, check_files=False)
    assert any(line.startswith(f"  - {message}") for line in str(err.value).splitlines()), str(err.value)


@pytest.mark.parametrize("overrides", [["rollout.mode=one_step_off"],
                                       ["rollout.mode=async", "rollout.max_staleness=0"],
                                       ["rollout.mode=async", "rollout.partial=finish"],
                                       ["rollout.mode=async", "rollout.partial=abort", "rollout.max_staleness=0"]])
def test_mode_settings_that_fit_are_taken(tiny_models, prompt_file, overrides):
    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]",
                                "data.batch_size=4", "actor.mini_batch_size=4", "critic.mini_batch_size=4",
                                *overrides])
    preflight_check(config, world_size=1, check_files=False)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.adv_estimator=remax"], "algorithm.adv_estimator=remax with parallel.rollout_ranks=1"),
    (["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"],
     "rollout.multi_turn.enable with parallel.rollout_ranks=1: the rollout ranks run no agent loop"),
])
def test_what_rollout_ranks_do_not_run_is_refused_naming_the_key(tiny_models, prompt_file, overrides, message):
    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]",
                                "data.batch_size=4", "actor.mini_batch_size=4", "critic.mini_batch_size=4",
                                "parallel.rollout_ranks=1",
                                *(o.format(prompts=prompt_file) for o in overrides)])
    with pytest.raises(ConfigError) as err:
        preflight_check(config, world_size=2, check_files=False)
    assert any(line.startswith(f"  - {message}") for line in str(err.value).splitlines()), str(err.value)


def test_validation_with_rollout_ranks_is_taken(tiny_models, prompt_file):
    """The rollout ranks generate the validation batches (tests/test_resume.py's partial run validates so)."""
    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]",
                                f"data.val_files=[{prompt_file}]", "data.batch_size=4", "actor.mini_batch_size=4",
                                "critic.mini_batch_size=4", "parallel.rollout_ranks=1"])
    preflight_check(config, world_size=2, check_files=False)
