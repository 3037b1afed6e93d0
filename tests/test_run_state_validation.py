"""A step checkpoint's trainer_state.json is read as hostile input: each part's `load_state_dict` checks every
value against its range (the dataset, the vocabulary, the run's lengths, the checkpoint's step) before it takes
any, refuses a bad one with one line naming its key, and changes nothing; through the CLI, a tampered state is
refused in one line naming the file and the key, and the run folder is left as it was."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from verl_mega.algorithms import RunningMeanStd
from verl_mega.algorithms.kl import AdaptiveKLController, FixedKLController
from verl_mega.data.sampler import ResumableBatchSampler
from verl_mega.rollout.engine import Response, SamplingParams
from verl_mega.rollout.partial import PartialRollout
from verl_mega.rollout.trajectory_buffer import Group, PendingGroups, RunBounds, TrajectoryBuffer
from verl_mega.trainer.rl.schedule import GREEDY, GeneratedRound, Pending, RolloutSchedule

from tests.faults.test_run_faults import snapshot, world_of_one

BOUNDS = RunBounds(prompts=12, vocab_size=64, max_prompt_tokens=8, max_response_tokens=6, newest_version=3)


def refused(load, state, *words) -> str:
    """`load(state)` raises one line holding `words`; returns it."""
    with pytest.raises(ValueError) as err:
        load(state)
    message = str(err.value)
    assert "\n" not in message and all(word in message for word in words), message
    return message


# --- the sampler -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, words", [
    ("batch_index", 10**15, "sampler.batch_index=1000000000000000 must be in [0, 3] (an epoch of 12 samples has 3"),
    ("batch_index", -1, "sampler.batch_index=-1 must be in [0, 3]"),
    ("epoch", -1, "sampler.epoch=-1 must be in [0, "),
    ("epoch", 2**64, "sampler.epoch=18446744073709551616 must be in [0, "),
    ("epoch", 1.5, "sampler.epoch is float, not int"),
    ("seed", True, "sampler.seed is bool, not int"),
    ("seed", "7", "sampler.seed is str, not int"),
])
def test_a_sampler_position_out_of_range_is_refused_and_changes_nothing(key, value, words):
    """Today's code took int() of each: 10**15 ran an epoch of no batches, -1 an order never drawn, 1.5 became 1."""
    sampler = ResumableBatchSampler(12, 4, seed=3)
    sampler.next_batch()
    before = sampler.state_dict()
    refused(sampler.load_state_dict, {**before, key: value}, words)
    assert sampler.state_dict() == before


# --- the KL controller and the reward normaliser ----------------------------------------------------------------

@pytest.mark.parametrize("controller", [FixedKLController(0.1), AdaptiveKLController(0.1, 0.05, 100)])
@pytest.mark.parametrize("value, words", [
    (-0.5, "kl_ctrl.value=-0.5 must be a finite number >= 0"),
    (math.nan, "kl_ctrl.value=nan must be a finite number"),
    (math.inf, "kl_ctrl.value=inf must be a finite number"),
    (True, "kl_ctrl.value is bool"),
    ("0.1", "kl_ctrl.value is str"),
])
def test_a_kl_coefficient_that_is_negative_or_not_a_number_is_refused(controller, value, words):
    refused(controller.load_state_dict, {"value": value}, words)
    assert controller.value == 0.1


@pytest.mark.parametrize("key, value, words", [
    ("count", -3.0, "reward_normalizer.count=-3.0 must be a finite number >= 0"),
    ("m2", -1.0, "reward_normalizer.m2=-1.0 must be a finite number >= 0"),
    ("mean", math.nan, "reward_normalizer.mean=nan must be a finite number"),
    ("m2", math.inf, "reward_normalizer.m2=inf"),
    ("count", None, "reward_normalizer.count is NoneType"),
])
def test_reward_statistics_with_a_negative_count_or_spread_or_nan_are_refused(key, value, words):
    normaliser = RunningMeanStd()
    normaliser.update(torch.tensor([1.0, 0.0, 0.5, 2.0]))
    before = normaliser.state_dict()
    refused(normaliser.load_state_dict, {**before, key: value}, words)
    assert normaliser.state_dict() == before


# --- the trajectory buffer and the pending groups ----------------------------------------------------------------

def saved_buffer() -> dict:
    buffer = TrajectoryBuffer(capacity=2)
    buffer.put(Group(5, {}, (Response(5, [7, 8], [-0.5, -0.25], token_versions=(2, 3)),)))
    return json.loads(json.dumps(buffer.state_dict()))


def spoil_response(**values):
    return lambda state: state["groups"][0]["responses"][0].update(values)


@pytest.mark.parametrize("spoil, words", [
    (spoil_response(token_ids=[64, 8]), "groups[0].responses[0].token_ids holds values outside [0, 63]: 8..64"),
    (spoil_response(token_ids=[-1, 8]), "token_ids holds values outside [0, 63]"),
    (spoil_response(token_ids=[7] * 100_000, token_versions=[2] * 100_000, logprobs=None),
     "token_ids holds 100000 tokens, more than this run's 6"),
    (spoil_response(token_versions=[2, 4]), "token_versions holds values outside [0, 3]: 2..4"),
    (spoil_response(logprobs=[math.nan, -0.25]), "logprobs holds NaN/inf"),
    (spoil_response(logprobs=[True, -0.25]), "logprobs must be a list of numbers"),
    (lambda state: state["groups"][0].update(index=12), "groups[0].index=12 must be in [0, 11] (data.train_files hold 12"),
    (lambda state: state["groups"][0].update(index=1.0), "groups[0].index is float, not int"),
])
def test_a_buffer_naming_unknown_prompts_tokens_or_future_versions_is_refused(spoil, words):
    """Today's buffer took token ids past the vocabulary, any length, versions newer than the checkpoint, NaN
    log-probs and prompts outside the dataset (the trainer indexed the dataset with them a step later)."""
    buffer = TrajectoryBuffer(capacity=2)
    state = saved_buffer()
    buffer.load_state_dict(state, BOUNDS)
    before = buffer.state_dict()
    spoil(state)
    refused(lambda s: buffer.load_state_dict(s, BOUNDS), state, words)
    assert buffer.state_dict() == before


@pytest.mark.parametrize("spoil, words", [
    (lambda item: item.update(index=10**15), "pending[0].index=1000000000000000 must be in [0, 11]"),
    (lambda item: item["responses"][0].update(token_versions=[9]), "token_versions holds values outside [0, 3]"),
    (lambda item: item["responses"][0].update(token_ids=[99]), "token_ids holds values outside [0, 63]"),
])
def test_pending_groups_naming_unknown_prompts_tokens_or_future_versions_are_refused(spoil, words):
    pending = PendingGroups(n=2)
    pending.expect(0, index=4, prompt={})
    pending.add([Response(0, [5], [-0.1], token_versions=(1,))])
    state = json.loads(json.dumps(pending.state_dict()))
    spoil(state["pending"][0])
    fresh = PendingGroups(n=2)
    refused(lambda s: fresh.load_state_dict(s, BOUNDS), state, words)
    assert len(fresh) == 0


# --- the rollout schedule ----------------------------------------------------------------------------------------

def one_step_off_state() -> dict:
    """A one_step_off schedule's state after its first fill: two rounds of two prompts, ReMax's greedy ids."""
    def generate(timer, step, gen_round):
        responses = [Response(p, [step, 1, 2], [-0.5] * 3) for p in range(2)]
        return Pending.done(GeneratedRound([step, step + 1], responses, greedy=[Response(p, [3]) for p in range(2)]))

    schedule = RolloutSchedule("one_step_off", 1, 2, 1, generate)
    schedule.fill(None, version=0)
    schedule.settle()
    return json.loads(json.dumps(schedule.state_dict()))


@pytest.mark.parametrize("spoil, words", [
    (lambda state: state["buffer"]["groups"][1]["prompt"].update({GREEDY: [64]}),
     f"rollout_schedule.buffer.groups[1].prompt.{GREEDY} holds values outside [0, 63]"),
    (lambda state: state["buffer"]["groups"][1]["prompt"].update({GREEDY: [1] * 7}),
     f"prompt.{GREEDY} holds 7 tokens, more than this run's 6"),
    (lambda state: state["buffer"]["groups"][0].update(index=-1), "rollout_schedule.buffer.groups[0].index=-1"),
    (lambda state: state.update(next_step=-2), "rollout_schedule.next_step=-2 must be >= 0"),
])
def test_a_schedule_whose_buffer_goes_past_the_run_is_refused_and_changes_nothing(spoil, words):
    """Today's schedule loaded the buffer before it looked at the prompts it named, and never at the greedy ids."""
    schedule = RolloutSchedule("one_step_off", 1, 2, 1, None)
    state = one_step_off_state()
    spoil(state)
    refused(lambda s: schedule.load_state_dict(s, BOUNDS), state, words)
    assert len(schedule.buffer) == 0 and schedule.next_step == 0


# --- the partial rollout -----------------------------------------------------------------------------------------

PARAMS = SamplingParams(max_new_tokens=6, n=1, seed=5, logprobs=True)


def partial_state(**sequence) -> dict:
    """A partial rollout's state with one sequence in flight: prompt [1, 2], two tokens of version 1."""
    base = {"prompt_index": 0, "sample": 0, "prompt": [1, 2], "tokens": [3, 4], "logprobs": [-0.5, -0.5],
            "versions": [1, 1], "seed": None}
    return {"chunk_tokens": 2, "params": {k: list(v) if isinstance(v, tuple) else v
                                          for k, v in dataclasses.asdict(PARAMS).items()},
            "version": 1, "rounds": 1, "started": 1, "discarded_tokens": 0, "sequences": [{**base, **sequence}]}


@pytest.mark.parametrize("state, words", [
    (partial_state(prompt=[1] * 100_000), "sequences[0].prompt holds 100000 tokens, more than this run's 8"),
    (partial_state(prompt=[1, 64]), "sequences[0].prompt holds values outside [0, 63]"),
    (partial_state(tokens=[-5, 4]), "sequences[0].tokens holds values outside [0, 63]"),
    (partial_state(logprobs=[math.nan, -0.5]), "sequences[0].logprobs holds NaN/inf"),
    ({**partial_state(versions=[7, 7]), "version": 7}, "version=7 must be in [0, 3] (the checkpoint's step)"),
])
def test_a_partial_rollout_past_the_runs_lengths_vocabulary_or_step_is_refused(state, words):
    """Today's rollout took a 100k-token prompt (it would have been fed whole to the engine), token ids past the
    vocabulary and a version newer than the checkpoint."""
    rollout = PartialRollout(None, PARAMS, 2, eos_token_ids=[0])
    rollout.load_state_dict(partial_state(), BOUNDS)
    before = rollout.state_dict()
    refused(lambda s: rollout.load_state_dict(s, BOUNDS), state, words)
    assert rollout.state_dict() == before


# --- through the CLI ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """The tiny model's inputs, and one-step runs of it that saved their step checkpoint: sync, and one_step_off."""
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("run_state")
    inputs = {"hf": make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2),
              "data": write_rows(make_task_rows("copy", 16, seed=0, max_digits=2), root / "copy.jsonl"),
              "config": root / "ppo.yaml"}
    inputs["config"].write_text((EXAMPLES / "ppo_gae_demo.yaml").read_text())
    runs = {}
    for mode in ("sync", "one_step_off"):
        runs[mode] = root / mode
        result = world_of_one(inputs, runs[mode], "trainer.save_every=1", f"rollout.mode={mode}")
        assert result.returncode == 0, result.stderr[-2000:]
    return inputs, runs


def tampered_copy(run_dir, tmp_path, tamper):
    """A copy of the run whose step checkpoint's trainer_state.json `tamper` edits, its digest re-recorded (as a
    writer that got it wrong would have recorded it): (run folder, the state file)."""
    import shutil

    from verl_mega.files.digest import file_entry
    from verl_mega.run.folder import STATE_FILE, RunFolder

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    step = RunFolder(copy).step(1)
    state = json.loads((step / STATE_FILE).read_text())
    tamper(state)
    (step / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
    record = json.loads((step / "digests.json").read_text())
    record["files"] = [file_entry(step, step / STATE_FILE) if entry["path"] == STATE_FILE else entry
                       for entry in record["files"]]
    (step / "digests.json").write_text(json.dumps(record, indent=1))
    return copy, step / STATE_FILE


@pytest.mark.slow
@pytest.mark.parametrize("mode, tamper, words", [
    ("sync", lambda state: state["sampler"].update(batch_index=10**15), "sampler.batch_index=1000000000000000"),
    ("sync", lambda state: state["kl_ctrl"].update(value=-1.0), "kl_ctrl.value=-1.0 must be a finite number >= 0"),
    ("one_step_off", lambda state: state.pop("rollout_schedule"),
     "it has no 'rollout_schedule', which this run (rollout.mode=one_step_off) resumes"),
])
def test_a_tampered_trainer_state_is_refused_in_one_line_and_the_run_folder_is_unchanged(saved_runs, tmp_path, mode,
                                                                                          tamper, words):
    """Today the sampler took 10**15 and the run trained on, the coefficient went negative, and the one_step_off run
    resumed with an empty buffer, its in-flight prompts lost without a word."""
    inputs, runs = saved_runs
    run_dir, state_file = tampered_copy(runs[mode], tmp_path, tamper)
    before = snapshot(run_dir)
    result = world_of_one(inputs, run_dir, "trainer.total_steps=2", f"rollout.mode={mode}")
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"{state_file}: {words}" in errors[0] and "remove checkpoint" in errors[0], errors[0]
    assert {k: v for k, v in snapshot(run_dir).items() if not k.endswith(".lock")} == before
