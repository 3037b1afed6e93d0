"""Checkpoint and resume of the PPO trainer: exact after SIGKILL, at another layout, refusals."""
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from verl_mega.run import checkpoints as run_checkpoints

from trainer_runs import NOT_COMPARED  # noqa: F401  (other test files import it from here)
from trainer_runs import PARTIAL_SAVE, PLANTED, make_inputs, records, run, train_command


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("resume"))


def final_actor_weights(run_dir) -> dict:
    """The run's final actor weights: shard folder/name -> tensor."""
    return {f"{path.parent.name}/{name}": tensor
            for path in sorted((run_dir / "final_actor").glob("iter_*/*/model_optim_rng.pt"))
            for name, tensor in torch.load(path, map_location="cpu", weights_only=True)["model"].items()}


def assert_resume_after_sigkill_is_bitwise(command_for, tmp_path, total_steps: int, save_every: int) -> None:
    """`command_for(run_dir)` runs `total_steps` steps saving every `save_every`: straight through, then killed
    with SIGKILL (its whole process group) at a random step after the first checkpoint and resumed; the resumed
    run's metrics and final actor weights must equal the straight run's bit for bit."""
    run(command_for(tmp_path / "straight"))
    expected = records(tmp_path / "straight")
    assert sorted(expected) == list(range(1, total_steps + 1))

    kill_after = random.randint(save_every + 1, total_steps - 1)
    print(f"killing after step {kill_after}")
    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen(command_for(interrupted), start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = interrupted / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= kill_after):
        assert process.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert len(run_checkpoints.complete_checkpoints(interrupted)) >= 1
    assert not (interrupted / "final_actor").exists(), "the run finished before the kill"

    resumed = run(command_for(interrupted))
    assert "resumed from" in resumed.stdout
    assert records(interrupted) == expected
    weights, expected_weights = final_actor_weights(interrupted), final_actor_weights(tmp_path / "straight")
    assert weights.keys() == expected_weights.keys() and weights
    assert all(torch.equal(weights[name], expected_weights[name]) for name in weights)


# One SIGKILL case, and it carries the most state: a GRPO run in bf16 (fp32 main weights and moments beside bf16
# model tensors) with dynamic sampling (its extra prompt draws and per-round seeds). fp32 resumes bitwise in the
# one_step_off case and in tests/test_training_state.py, the critic's bf16 state in the layout change (both below).
# The random model's responses would all score 0 on the copy task; this reward gives about half of them 1.
DYNAMIC_SAMPLING = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=8",
                    "reward.function=tests.sampling_rewards:odd_first_character")


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_gives_the_same_metrics(setup, tmp_path):
    layout = ["parallel.tp=2", "parallel.pp=1", "trainer.total_steps=5", "model.dtype=bf16", *DYNAMIC_SAMPLING]
    assert_resume_after_sigkill_is_bitwise(
        lambda run_dir: train_command(setup, run_dir, 4, *layout, example="grpo_demo.yaml"), tmp_path,
        total_steps=5, save_every=2)
    # every step's batch filled (4 prompts), some of them in more than one round
    steps = records(tmp_path / "straight").values()
    assert all(record["filter_groups/kept_groups"] == 4 for record in steps)
    assert max(record["filter_groups/gen_rounds"] for record in steps) >= 2


@pytest.mark.slow
def test_resume_at_another_layout_and_partial_saves_are_ignored(bf16_layout_runs):
    """(2, 2, 2) for 2 steps, then (2, 1, 2) to step 4 beside a planted half-written save of step 4 (the bf16 PPO
    run that tests/test_mixed_precision.py checks too): the resume starts from the complete step 2 and the step 4
    save starts its temp folder afresh."""
    record = bf16_layout_runs("ppo_gae")
    run_dir = record["run_dir"]
    assert [p.name for p in record["first_checkpoints"]] == ["step_000002"]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000002'} at step 2" in record["resumed_stdout"]
    steps = sorted(records(run_dir))
    assert steps == [1, 2, 3, 4]
    assert (run_dir / "final_actor" / "verl_mega_manifest.json").is_file()
    assert not (run_dir / "checkpoints" / PARTIAL_SAVE).exists()
    assert not (run_dir / "checkpoints" / "step_000004" / PLANTED).exists()


ONE_PROCESS = ("parallel.tp=1", "parallel.pp=1")
# The one_step_off run trains LoRA adapters (actor and critic): their step checkpoints (adapters, optimizer
# state, no base) must resume bitwise after SIGKILL too, and the weights pushed to the rollout rank are merged.
LORA = ("actor.lora.rank=4", "critic.lora.rank=4")


@pytest.fixture(scope="module")
def two_step_sync_run(setup, tmp_path_factory):
    """One process, 2 steps in rollout.mode=sync: its run folder and metrics (read before a test reuses it)."""
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    run(train_command(setup, run_dir, 1, *ONE_PROCESS, "trainer.total_steps=2"))
    return run_dir, records(run_dir)


# Partial rollouts in chunks of the whole response budget (data.max_response_length=4 in the example): each
# round's first chunk is its one call, seeded by its slot, so they too must be sync's bit for bit.
WHOLE_CHUNKS = ("rollout.partial=finish", "rollout.partial_chunk_tokens=4")


@pytest.mark.slow
@pytest.mark.parametrize("partial", [(), WHOLE_CHUNKS], ids=["rounds", "partial-whole-chunks"])
def test_async_at_staleness_0_is_sync_bitwise(setup, tmp_path, two_step_sync_run, partial):
    """Same seeds, rollout.mode=async with max_staleness 0: every metric of every step equals sync's bit for bit
    (the staleness metrics aside, which sync does not log: all 0 here). Could fail if async drew prompts or seeds
    in another order, kept a round ahead, or its buffer changed a token or log-prob; with partial rollouts, if a
    round's first chunk were not seeded by its slot or a chunk split a response."""
    _, expected = two_step_sync_run
    run(train_command(setup, tmp_path / "async", 1, *ONE_PROCESS, "trainer.total_steps=2", "rollout.mode=async",
                      "rollout.max_staleness=0", *partial))
    got = records(tmp_path / "async")
    assert all(step["async/staleness_max"] == 0 and step["async/staleness_hist/0"] == 1 for step in got.values())
    assert {step: {k: v for k, v in record.items() if not k.startswith("async/")}
            for step, record in got.items()} == expected


@pytest.mark.slow
def test_sync_on_a_rollout_rank_of_its_own_is_sync_colocated_bitwise(setup, tmp_path, two_step_sync_run):
    """The default mode with 1 training and 1 rollout process: each step pushes the weights, asks the rollout rank
    for its round and waits for it; every metric of every step equals the colocated run's bit for bit. Could fail
    if a pushed weight, a seed or a prompt's share differed, or the rollout rank answered out of order."""
    _, expected = two_step_sync_run
    run(train_command(setup, tmp_path / "disaggregated", 2, *ONE_PROCESS, "trainer.total_steps=2",
                      "parallel.rollout_ranks=1"))
    assert records(tmp_path / "disaggregated") == expected


@pytest.mark.slow
def test_one_step_off_resumes_exactly_and_runs_the_same_on_a_rollout_rank_of_its_own(setup, tmp_path):
    """rollout.mode=one_step_off keeps the next step's round, generated by the weights before this step's
    update, in its buffer across a checkpoint: killed after step 3 and resumed from step 2's checkpoint, the run
    logs the uninterrupted run's metrics and ends with its weights, bit for bit. Could fail if the buffer, its
    versions or the next seed slot were not saved (the resumed step 3 would train on a fresh round). The
    staleness histogram: step 1 trains on its own round (version 0), every later step on the round of the
    weights one version older. The same run with 1 training and 1 rollout process (parallel.rollout_ranks=1:
    the rollout rank generates step k + 1's round while the training rank trains on step k's) logs the same
    metrics, bit for bit: could fail if a pushed weight, a seed or the data/version schedule differed. Both roles
    train LoRA adapters here: the resume also fails if a step checkpoint lost an adapter or its optimizer state,
    and the rollout rank's run differs if the push sent base weights instead of the merged ones."""
    steps = ("trainer.total_steps=4", "rollout.mode=one_step_off", *LORA)
    assert_resume_after_sigkill_is_bitwise(lambda run_dir: train_command(setup, run_dir, 1, *ONE_PROCESS, *steps),
                                           tmp_path, total_steps=4, save_every=2)
    colocated = records(tmp_path / "straight")
    hist = [{k: v for k, v in record.items() if k.startswith("async/staleness_hist/")}
            for _, record in sorted(colocated.items())]
    assert hist == [{"async/staleness_hist/0": 1.0}] + [{"async/staleness_hist/0": 0.0,
                                                         "async/staleness_hist/1": 1.0}] * 3
    run(train_command(setup, tmp_path / "disaggregated", 2, *ONE_PROCESS, *steps, "parallel.rollout_ranks=1"))
    assert records(tmp_path / "disaggregated") == colocated


# Chunks of one token, at most one version stale: rounds start a chunk apart, so every step's weights arrive
# with sequences part-way (their tokens sampled by two versions). Two rollout replicas (each of the 2 training
# ranks at TP 2 is one, colocated; 2 rollout ranks at rollout TP 1), each with a partial rollout of its own.
PARTIAL = ("trainer.total_steps=4", "rollout.mode=async", "rollout.max_staleness=1", "rollout.partial=finish",
           "rollout.partial_chunk_tokens=1", "parallel.tp=2", "parallel.pp=1")


@pytest.mark.slow
def test_partial_rollouts_resume_with_sequences_in_flight_and_run_the_same_on_rollout_ranks(setup, tmp_path):
    """async partial rollouts (finish) on two rollout replicas, colocated (2 processes at TP 2) for 4 steps; step
    2's checkpoint holds sequences in flight (tokens of version 1 in both replicas' partial rollouts). A copy of
    the run folder cut back to that checkpoint resumes with 2 training and 2 rollout processes (each rollout rank
    gets its replica's sequences in flight, generates the next step's groups in chunks while the training ranks
    train, and takes each push between two chunks; the second training rank gets the leader's progress): it logs
    the colocated run's metrics and ends with its weights, bit for bit. Could fail if the partial rollouts' state,
    the groups pending or the buffer were not saved or not sent to the rollout ranks, if a push did not reach the
    sequences in flight, if the two placements chunked, split or seeded the replicas differently, or a training
    rank trained on other groups than the leader. Some step trains on tokens of two versions. Both validate on the
    training prompts (the rollout ranks generating the validation batches for the resumed run): the same greedy
    responses, so the same val/ metrics."""
    straight, (_, _, data) = tmp_path / "straight", setup
    val = tmp_path / "val.jsonl"  # validation too, on 4 of the training prompts: before step 1 and after step 4
    val.write_text("".join(Path(data).read_text().splitlines(keepends=True)[:4]))
    validated = (*PARTIAL, f"data.val_files=[{val}]")
    run(train_command(setup, straight, 2, *validated))
    expected = records(straight)
    state = json.loads((straight / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    rollouts = state["rollout_schedule"]["rollouts"]
    assert len(rollouts) == 2 and all(any(sequence["tokens"] for sequence in rollout["sequences"])
                                      for rollout in rollouts)
    assert any(0 < record.get("async/staleness_hist/0", 0) < 1 for record in expected.values())
    assert "val/reward_mean" in expected[0] and "val/reward_mean" in expected[4]

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_000004", "final_*"))
    result = run(train_command(setup, resumed, 4, *validated, "parallel.rollout_ranks=2"))
    assert "resumed from" in result.stdout
    assert records(resumed) == expected
    weights, expected_weights = final_actor_weights(resumed), final_actor_weights(straight)
    assert weights.keys() == expected_weights.keys() and weights
    assert all(torch.equal(weights[name], expected_weights[name]) for name in weights)


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(setup, tmp_path, two_step_sync_run):
    from verl_mega.models.tiny import make_tiny_hf_model

    root, _, _ = setup
    run_dir, _ = two_step_sync_run
    other = make_tiny_hf_model(tmp_path / "other", "qwen2", vocab_size=64, num_hidden_layers=2, hidden_size=32,
                               intermediate_size=64)
    command = train_command(setup, run_dir, 1, "parallel.tp=1", "parallel.pp=1", "trainer.total_steps=3",
                            f"model.hf_path={other}")
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode != 0
    assert "was written for another model" in result.stderr


def test_only_complete_checkpoints_are_listed(tmp_path):
    for name in ("step_000002", "step_000010", ".step_000012.tmp", "step_x"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert [p.name for p in run_checkpoints.complete_checkpoints(tmp_path)] == ["step_000002", "step_000010"]
