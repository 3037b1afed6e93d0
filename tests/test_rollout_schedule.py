"""The rollout schedule (rollout.mode): which generated round a step trains on, the weight version it lags by,
its checkpointed buffer, and the pre-flight refusals of the mode's keys."""
import json

import pytest
import torch

from verl_mega.config import ConfigError, load_config
from verl_mega.config.errors import UserError
from verl_mega.rollout.engine import Response
from verl_mega.trainer.preflight import preflight_check
from verl_mega.trainer.rollout_schedule import (
    GeneratedRound, RolloutSchedule, rounds_ahead, staleness_metrics,
)


class Weights:
    """A stand-in for the trainer's side of generation: the current version, and a round per slot asked for,
    its responses named by the slot so a test can tell which generation it trains on."""

    def __init__(self):
        self.version, self.slots = 0, []

    def generate(self, step: int, gen_round: int) -> GeneratedRound:
        self.slots.append((step, gen_round))
        tokens = [step, gen_round]
        routed = torch.tensor([[[1, 2]]], dtype=torch.int16)
        return GeneratedRound([step], [Response(0, tokens, [-0.5 - step, -1 / 3], routed_experts=routed)],
                              self.version, step, gen_round, greedy=[Response(0, tokens[:1], None)])


def trained_versions(mode: str, staleness: int, steps: int, rounds_per_step=lambda step: 1):
    """(slot, version) of the rounds each of `steps` steps trains on; the weights advance one version a step."""
    weights, schedule = Weights(), RolloutSchedule(rounds_ahead(mode, staleness))
    trained = []
    for step in range(steps):
        schedule.fill(weights.generate)
        for gen_round in range(rounds_per_step(step)):
            taken = schedule.take(step, gen_round, weights.generate)
            trained.append(((taken.step, taken.gen_round), taken.version, step))
        weights.version += 1
    return trained, weights.slots


def test_sync_and_async_at_staleness_0_train_each_step_on_its_own_fresh_round():
    """Could fail if async kept a round ahead at staleness 0 (it must be sync, bitwise: the same slots, so the
    same seeds and sampler draws, in the same order)."""
    for mode in ("sync", "async"):
        trained, generated = trained_versions(mode, 0, 4)
        assert trained == [((step, 0), step, step) for step in range(4)]
        assert generated == [(step, 0) for step in range(4)]


def test_one_step_off_trains_on_the_round_of_the_weights_one_version_older():
    """The first step generates two rounds; step k trains on the round generated before step k-1's update.
    Could fail if a step generated after taking, or took the newest round."""
    trained, generated = trained_versions("one_step_off", 0, 4)
    assert generated[:2] == [(0, 0), (1, 0)] and len(generated) == 5
    assert [(slot, version) for slot, version, _ in trained] == [((0, 0), 0), ((1, 0), 0), ((2, 0), 1), ((3, 0), 2)]
    assert trained_versions("async", 1, 4) == (trained, generated)  # one step off is async at staleness 1


def test_async_never_trains_on_data_older_than_max_staleness():
    trained, _ = trained_versions("async", 2, 6)
    lags = [step - version for _, version, step in trained]
    assert lags == [0, 1, 2, 2, 2, 2]


def test_dynamic_sampling_rounds_take_the_buffer_then_generate_in_their_own_slots():
    """A step's later rounds use what is left ahead, then generate fresh in slot (step, round >= 1), which no
    round ahead (slot (step', 0)) can collide with. Could fail if two generations shared a seed slot."""
    trained, generated = trained_versions("one_step_off", 0, 3, rounds_per_step=lambda step: 3 if step == 1 else 1)
    assert [slot for slot, _, step in trained if step == 1] == [(1, 0), (2, 0), (1, 2)]
    assert len(set(generated)) == len(generated)


def test_the_buffer_survives_a_checkpoint_as_json_exactly():
    """Could fail if the state lost a log-prob's last bit, the routing's dtype, or the next slot."""
    weights, schedule = Weights(), RolloutSchedule(rounds_ahead("async", 2))
    schedule.fill(weights.generate)
    schedule.take(0, 0, weights.generate)
    saved = json.loads(json.dumps(schedule.state_dict()))
    resumed = RolloutSchedule(rounds_ahead("async", 2))
    resumed.load_state_dict(saved, dataset_size=8)
    assert resumed.next_step == 3 and len(resumed.buffer) == 2
    for before, after in zip(schedule.buffer, resumed.buffer):
        assert (after.indices, after.version, after.step, after.greedy) == (before.indices, before.version,
                                                                            before.step, before.greedy)
        assert after.responses == before.responses  # tokens and log-probs, bit for bit
        assert torch.equal(after.responses[0].routed_experts, before.responses[0].routed_experts)
        assert after.responses[0].routed_experts.dtype == torch.int16


@pytest.mark.parametrize("edit, words", [
    (lambda state: state["buffer"][0].update(indices=[99]), "a prompt index outside the 8 prompts"),
    (lambda state: state["buffer"][0].pop("version"), "'version'"),
    (lambda state: state.update(next_step="x"), "invalid literal"),
])
def test_a_tampered_buffer_is_refused_in_one_line(edit, words):
    weights, schedule = Weights(), RolloutSchedule(2)
    schedule.fill(weights.generate)
    state = json.loads(json.dumps(schedule.state_dict()))
    edit(state)
    with pytest.raises(UserError, match="rollout_schedule is malformed") as err:
        RolloutSchedule(2).load_state_dict(state, dataset_size=8)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_staleness_metrics_give_the_lag_histogram():
    metrics = staleness_metrics([3, 3, 2, 1], current=3)
    assert metrics == {"rollout/staleness_mean": 0.75, "rollout/staleness_max": 2.0, "rollout/staleness_share/0": 0.5,
                       "rollout/staleness_share/1": 0.25, "rollout/staleness_share/2": 0.25}


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"copy: {i}"}) for i in range(8)))
    return path


@pytest.mark.parametrize("overrides, message", [
    (["rollout.mode=later"], "rollout.mode 'later' is unknown; known: sync, one_step_off, async"),
    (["rollout.mode=async", "rollout.max_staleness=-1"], "rollout.max_staleness must be >= 0"),
    (["rollout.mode=async", "rollout.partial=maybe"], "rollout.partial 'maybe' is unknown; known: off, finish"),
    (["rollout.mode=async", "rollout.partial_chunk_tokens=0"], "rollout.partial_chunk_tokens must be >= 1"),
    (["rollout.max_staleness=3"], "rollout.max_staleness=3 applies to rollout.mode=async only (this run's is sync)"),
    (["rollout.mode=one_step_off", "rollout.partial=abort"], "rollout.partial=abort applies to rollout.mode=async"),
    (["rollout.mode=async", "rollout.partial=finish"], "rollout.partial=finish: colocated generation runs between"),
    (["rollout.mode=one_step_off", "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"],
     "rollout.mode=one_step_off with rollout.multi_turn.enable"),
    (["rollout.mode=async", "actor.router_replay=rollout"], "rollout.mode=async with actor.router_replay=rollout"),
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
                                       ["rollout.mode=async", "rollout.max_staleness=0"]])
def test_mode_settings_that_fit_are_taken(tiny_models, prompt_file, overrides):
    config = load_config(None, [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompt_file}]",
                                "data.batch_size=4", "actor.mini_batch_size=4", "critic.mini_batch_size=4",
                                *overrides])
    preflight_check(config, world_size=1, check_files=False)
