"""Disaggregated placement: which ranks train and which generate, who sends which rollout TP slice to whom, for
every world of 2..8 processes; and the pre-flight's one line for each split that cannot run."""
import json

import pytest

from verl_mega.config import ConfigError, load_config
from verl_mega.parallel.layout import rollout_coordinates
from verl_mega.parallel.placement import (
    check_placement, placement_for, rollout_peer, slice_holders, training_data_parallel_size, weight_routes,
)
from verl_mega.trainer.preflight import preflight_check

WORLDS = range(2, 9)


def splits():
    """(world, rollout_ranks, rollout_tp, training tp) of every placement that fits, tp a divisor of the
    training world that rollout_tp divides."""
    for world in WORLDS:
        for rollout_ranks in range(1, world):
            train = world - rollout_ranks
            for tp in (size for size in range(1, train + 1) if train % size == 0):
                for rollout_tp in (size for size in range(1, tp + 1) if tp % size == 0):
                    if rollout_ranks % rollout_tp == 0:
                        yield world, rollout_ranks, rollout_tp, tp


@pytest.mark.parametrize("world", WORLDS)
def test_the_last_ranks_generate_and_each_role_numbers_its_own(world):
    for rollout_ranks in range(world):
        placements = [placement_for(rank, world, rollout_ranks) for rank in range(world)]
        trainers = [p for p in placements if p.role == "train"]
        generators = [p for p in placements if p.role == "rollout"]
        assert [p.global_rank for p in generators] == list(range(world - rollout_ranks, world))
        assert [p.rank_in_role for p in trainers] == list(range(world - rollout_ranks))
        assert [p.rank_in_role for p in generators] == list(range(rollout_ranks))
        assert {p.role_size for p in trainers} == {world - rollout_ranks}
        assert all(p.disaggregated == (rollout_ranks > 0) for p in placements)
        assert {(p.train_ranks, p.rollout_ranks) for p in placements} == {
            (tuple(range(world - rollout_ranks)), tuple(range(world - rollout_ranks, world)))}


def test_colocated_is_every_rank_training():
    placement = placement_for(2, 4, 0)
    assert (placement.role, placement.rank_in_role, placement.role_size, placement.replicas) == ("train", 2, 4, 0)
    assert weight_routes(placement) == ()


@pytest.mark.parametrize("world, rollout_ranks, rollout_tp, tp", list(splits()))
def test_every_rollout_rank_gets_its_slice_from_a_training_rank_that_holds_it(world, rollout_ranks, rollout_tp, tp):
    placement = placement_for(0, world, rollout_ranks, rollout_tp, tp)
    train = len(placement.train_ranks)
    routes = weight_routes(placement)
    assert [route.target for route in routes] == list(placement.rollout_ranks)
    assert placement.replicas == rollout_ranks // rollout_tp
    for route in routes:
        at = placement.rollout_coordinates(route.target)
        assert route.slice == at.rollout_tp_rank and at.replica < placement.replicas
        # The HybridEngine's own arithmetic on the sending rank streams that very slice.
        assert route.source in placement.train_ranks
        assert rollout_coordinates(route.source, train, tp, rollout_tp).rollout_tp_rank == route.slice
        assert rollout_peer(placement, route.target) == route
    # Pushes spread over the holders of a slice: no holder sends more than one push beyond another.
    for slice_index, holders in enumerate(slice_holders(placement)):
        sent = [sum(route.source == holder for route in routes) for holder in holders]
        assert max(sent) - min(sent) <= 1, (slice_index, sent)


@pytest.mark.parametrize("world, rollout_ranks, rollout_tp, message", [
    (4, 4, 1, "parallel.rollout_ranks=4 must leave at least one training rank in a world of 4 processes"),
    (4, 5, 1, "parallel.rollout_ranks=5 must leave at least one training rank"),
    (4, -1, 1, "parallel.rollout_ranks must be an integer >= 0 (0: colocated), got -1"),
    (6, 3, 2, "parallel.rollout_ranks=3 must be a multiple of parallel.rollout_tp=2 (whole rollout replicas)"),
])
def test_a_split_that_cannot_run_is_refused_naming_the_key(world, rollout_ranks, rollout_tp, message):
    names = {"rollout_ranks": "parallel.rollout_ranks", "rollout_tp": "parallel.rollout_tp"}
    with pytest.raises(ValueError) as error:
        check_placement(world, rollout_ranks, rollout_tp, names)
    assert str(error.value) == message or str(error.value).startswith(message)


def test_the_training_layout_is_sized_by_the_training_ranks_alone():
    assert training_data_parallel_size(placement_for(0, 6, 2), tp=2, pp=1) == 2
    with pytest.raises(ValueError, match=r"rollout_ranks=3 leaves 3 training processes: tp \* pp = 2 must divide"):
        training_data_parallel_size(placement_for(0, 6, 3), tp=2, pp=1)


@pytest.fixture
def rl_overrides(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"copy: {i}", "reward_model": {"ground_truth": str(i)}})
                                 for i in range(8)))
    return [f"model.hf_path={tiny_models['qwen2']}", f"data.train_files=[{prompts}]", "parallel.tp=2",
            "data.batch_size=4", "actor.mini_batch_size=4", "critic.mini_batch_size=4"]


def test_a_disaggregated_config_that_fits_passes_the_preflight(rl_overrides):
    preflight_check(load_config(None, rl_overrides + ["parallel.rollout_ranks=2"]), world_size=4)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.rollout_ranks=4"], 4, "parallel.rollout_ranks=4 must leave at least one training rank"),
    (["parallel.rollout_ranks=3", "parallel.rollout_tp=2", "rollout.engine=vllm"], 6,
     "parallel.rollout_ranks=3 must be a multiple of parallel.rollout_tp=2"),
    (["parallel.rollout_ranks=1"], 4, "parallel.rollout_ranks=1 leaves 3 training processes: parallel.tp * "
     "parallel.pp = 2 must divide the number of processes (3)"),
    (["parallel.rollout_ranks=4", "parallel.rollout_tp=4", "rollout.engine=vllm"], 6,
     "parallel.rollout_tp=4 must divide the training TP size parallel.tp=2"),
    (["parallel.rollout_ranks=2", "parallel.bridge_timeout_s=0"], 4, "parallel.bridge_timeout_s must be in (0, 1000000000] (seconds), got 0.0"),
    (["parallel.rollout_ranks=2", "parallel.weight_push_bucket_mb=0"], 4,
     "parallel.weight_push_bucket_mb must be >= 1, got 0"),
    (["parallel.rollout_ranks=2", "job=sft"], 4, "parallel.rollout_ranks=2: the sft job generates nothing"),
    (["parallel.rollout_ranks=2", "data.batch_size=3", "actor.mini_batch_size=3", "critic.mini_batch_size=3",
      "parallel.tp=1"], 4, "data.batch_size=3 must be divisible by the number of rollout replicas 2 "
     "(parallel.rollout_ranks / parallel.rollout_tp)"),
])
def test_preflight_names_the_placement_key_in_one_line(rl_overrides, overrides, world, message):
    with pytest.raises(ConfigError) as error:
        preflight_check(load_config(None, rl_overrides + overrides), world_size=world, check_files=False)
    lines = str(error.value).splitlines()
    assert sum(message in line for line in lines) == 1, lines
    key = message.split("=")[0].split(":")[0]
    assert sum(key in line for line in lines) == 1, lines
