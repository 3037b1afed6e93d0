"""The RL step's DAPO stage: generation seeds per round, rows of several rounds joined into one batch, and
examples/dapo.yaml: through the pre-flight check, and two steps of it on a tiny model (slow)."""
import json

import pytest
import torch

from verl_mega.config import load_config
from verl_mega.demo import EXAMPLES
from verl_mega.roles.reward import RewardOutput
from verl_mega.trainer.preflight import preflight_check
from verl_mega.trainer.rl.generation import rollout_seed
from verl_mega.trainer.rl.rows import concat_rows, take_rows


def test_rollout_seeds_are_a_pure_function_of_step_round_and_replica():
    base, replicas = 7, 4
    # Round 0 keeps the seeds of runs made before dynamic sampling: base + step * replicas + replica.
    assert [rollout_seed(base, 3, 0, replicas, replica) for replica in range(replicas)] == [19, 20, 21, 22]
    seeds = {rollout_seed(base, step, gen_round, replicas, replica)
             for step in range(50) for gen_round in range(10) for replica in range(replicas)}
    assert len(seeds) == 50 * 10 * replicas


def test_rows_of_rounds_are_taken_and_joined_field_by_field():
    def round_of(offset):
        scores = torch.arange(4, dtype=torch.float32) + offset
        extras = {"acc": (scores > offset + 1).float()} if offset != 10 else {}
        reward = RewardOutput(scores, scores[:, None].repeat(1, 3), extras, ({"pred": str(offset)},) * 4,
                              {1: "ran past 5 s"})
        return {"index": [offset + i for i in range(4)], "raw_prompt": ["p"] * 4}, [[i] for i in range(4)], reward

    parts = [(take_rows(rows, keep), take_rows(responses, keep), reward.take(keep))
             for (rows, responses, reward), keep in ((round_of(0), [2, 3]), (round_of(10), [1]),
                                                     (round_of(20), [0, 1, 2]))]
    rows, responses = (concat_rows(list(part)) for part in list(zip(*parts))[:2])
    reward = RewardOutput.concat([part[2] for part in parts])
    assert rows == {"index": [2, 3, 11, 20, 21, 22], "raw_prompt": ["p"] * 6}
    assert responses == [[2], [3], [1], [0], [1], [2]]
    assert reward.scores.tolist() == [2, 3, 11, 20, 21, 22] and reward.token_level_rewards.shape == (6, 3)
    # a field the middle round's reward did not return is NaN on its rows; the kept timeouts are renumbered
    assert reward.extras["acc"].tolist()[:2] == [1, 1] and reward.extras["acc"][2].isnan()
    assert reward.extras["acc"].tolist()[3:] == [0, 0, 1]
    assert [fields["pred"] for fields in reward.sample_fields] == ["0", "0", "10", "20", "20", "20"]
    assert reward.timeouts == {2: "ran past 5 s", 4: "ran past 5 s"}
    with pytest.raises(TypeError, match="not a per-row value"):
        take_rows(3, [0])


def dapo_overrides(hf, data, run_dir):
    return [f"model.hf_path={hf}", f"data.train_files=[{data}]", f"trainer.run_dir={run_dir}"]


@pytest.fixture
def copy_rows(tmp_path):
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows

    return write_rows(make_task_rows("copy", 64, seed=0, max_digits=2), tmp_path / "copy.jsonl")


def test_the_dapo_example_passes_the_preflight_check_at_its_layout(tiny_models, copy_rows, tmp_path):
    config = load_config(EXAMPLES / "dapo.yaml", dapo_overrides(tiny_models["qwen2"], copy_rows, tmp_path / "run"))
    loss = config.actor.loss
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert config.algorithm.filter_groups.enable and config.reward.overlong_buffer.enable
    assert config.algorithm.overlong_filtering
    preflight_check(config, world_size=2)


@pytest.mark.slow
def test_two_steps_of_the_dapo_example_log_the_sampling_and_the_overlong_share(tiny_models, copy_rows, tmp_path):
    """A random tiny model rarely copies a digit and never stops: most groups score all alike (dynamic sampling
    takes every round it may) and most responses are cut at the budget."""
    from verl_mega.demo import train

    run_dir = tmp_path / "run"
    train(EXAMPLES / "dapo.yaml", 1, [*dapo_overrides(tiny_models["qwen2"], copy_rows, run_dir),
                                      "trainer.total_steps=2", "trainer.tensorboard=false"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["filter_groups/kept_groups"] + record["filter_groups/dropped_groups"] >= 16
        assert 1 <= record["filter_groups/gen_rounds"] <= 4
        assert record["dapo/overlong_fraction"] > 0.5
        assert -0.5 <= record["dapo/overlong_penalty_mean"] < -0.25


@pytest.mark.slow
def test_out_of_rounds_with_on_exhausted_stop_the_run_ends_with_one_line_naming_the_key(tiny_models, copy_rows,
                                                                                        tmp_path):
    """The random model leaves fewer than 16 informative groups after 4 rounds (see the test above)."""
    import subprocess

    from verl_mega.parallel.spawn import run_torchrun

    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_torchrun(1, "verl_mega.trainer.main", [
            "--config", str(EXAMPLES / "dapo.yaml"), *dapo_overrides(tiny_models["qwen2"], copy_rows, tmp_path / "run"),
            "trainer.total_steps=1", "trainer.tensorboard=false", "algorithm.filter_groups.on_exhausted=stop"],
            capture_output=True)
    assert failed.value.returncode == 2
    lines = [line for line in failed.value.stderr.splitlines() if "dynamic sampling kept" in line]
    assert lines and "in algorithm.filter_groups.max_num_gen_batches=4 rounds" in lines[0]
    assert "algorithm.filter_groups.on_exhausted=train" in lines[0]
