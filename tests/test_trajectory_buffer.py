"""The trajectory buffer of asynchronous rollouts (bounds, the staleness filter and its drop count, the saved state
through JSON and torch's weights-only loader, producers and a consumer in threads), the groups gathered from a
partial rollout's finished responses, and the `async/` staleness metrics."""
from __future__ import annotations

import io
import json
import threading

import pytest
import torch

from verl_mega.algorithms.staleness import staleness_metrics
from verl_mega.checkpoint.safe_unpickle import load_weights_only
from verl_mega.rollout.engine import EpisodeInfo, Response
from verl_mega.rollout.trajectory_buffer import Group, PendingGroups, RunBounds, TrajectoryBuffer

# What the states here may hold: the run's dataset, vocabulary, lengths and newest weight version.
BOUNDS = RunBounds(prompts=100, vocab_size=64, max_prompt_tokens=16, max_response_tokens=16, newest_version=9)


def group(index: int, *versions: tuple[int, ...]) -> Group:
    """A group of one response per `versions` entry, its tokens sampled by those versions."""
    responses = tuple(Response(index, [7 + i for i in range(len(v))], [-0.5] * len(v), token_versions=v)
                      for v in versions)
    return Group(index, {"input_ids": [1, 2, index], "data_source": "copy", "reward_model": {"ground_truth": "12"}},
                 responses)


def test_a_group_is_tagged_with_its_oldest_and_newest_token_version():
    tagged = group(0, (3, 3, 4), (2, 5))
    assert (tagged.oldest_version, tagged.newest_version) == (2, 5)
    with pytest.raises(ValueError, match="no weight version per token"):
        Group(0, {}, (Response(0, [1, 2]),))
    with pytest.raises(ValueError, match="only JSON types"):
        Group(0, {"input_ids": torch.tensor([1])}, group(0, (1,)).responses)


def test_a_full_buffer_refuses_without_waiting_and_takes_first_put_first():
    buffer = TrajectoryBuffer(capacity=2)
    assert buffer.put(group(0, (0,))) and buffer.put(group(1, (0,)))
    assert not buffer.put(group(2, (0,)), timeout=0.01)
    assert len(buffer) == 2
    assert buffer.take(3 - 1, current_version=0, max_staleness=0)[0].index == 0
    assert len(buffer) == 0 and buffer.put(group(2, (0,)))
    with pytest.raises(ValueError, match=r"n_groups must be an integer in \[1, 2\]"):
        buffer.take(3, current_version=0, max_staleness=0)


def test_take_skips_and_counts_groups_older_than_max_staleness():
    """A group whose oldest token is more than max_staleness versions behind is dropped and counted; one within it
    is taken even if newer groups were put after it; too few fresh groups take nothing."""
    buffer = TrajectoryBuffer(capacity=8)
    for index, versions in enumerate([(1, 3), (3, 3), (2, 4), (4,)]):
        buffer.put(group(index, versions))
    assert buffer.take(3, current_version=4, max_staleness=2) is not None  # 1 is 3 behind: dropped; 2 left
    assert buffer.dropped_stale == 1 and len(buffer) == 0
    for index, versions in enumerate([(2,), (4,)]):
        buffer.put(group(index, versions))
    assert buffer.take(2, current_version=5, max_staleness=2) is None  # version 2 is 3 behind 5
    assert buffer.dropped_stale == 2 and len(buffer) == 1
    assert [g.index for g in buffer.take(1, current_version=5, max_staleness=1)] == [1]
    buffer.put(group(0, (6,)))
    with pytest.raises(ValueError, match="newer than the current 5"):
        buffer.take(1, current_version=5, max_staleness=1)


def test_max_staleness_zero_takes_only_groups_of_the_current_weights():
    buffer = TrajectoryBuffer(capacity=4)
    buffer.put(group(0, (0, 1)))
    buffer.put(group(1, (1, 1)))
    assert [g.index for g in buffer.take(1, current_version=1, max_staleness=0)] == [1]
    assert buffer.dropped_stale == 1


def test_the_state_round_trips_through_json_and_torchs_weights_only_loader():
    """What `state_dict` returns is a job state's JSON as it is, and loads under torch's weights-only unpickler
    too (the checkpoint readers' rules); the loaded buffer takes the same groups."""
    buffer = TrajectoryBuffer(capacity=4)
    episode = EpisodeInfo([1, 2], [{"role": "user", "content": "2+2"}], [{"turn": 0, "name": "calc"}],
                          [{"turn": 0, "result": "4"}], [1], False)
    buffer.put(group(0, (1, 2)))
    buffer.put(Group(5, {"input_ids": [3]}, (Response(5, [4, 5], [-1.0, -2.0], [1, 0], episode,
                                                      token_versions=(2, 2)),)))
    buffer.take(1, current_version=9, max_staleness=3)  # drops both groups, counted
    buffer.put(group(0, (8, 9)))
    buffer.put(Group(5, {"input_ids": [3]}, (Response(5, [4, 5], [-1.0, -2.0], [1, 0], episode,
                                                      token_versions=(9, 9)),)))
    state = buffer.state_dict()
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    for loaded in (json.loads(json.dumps(state)), load_weights_only(saved, "the test's buffer")):
        again = TrajectoryBuffer(capacity=4)
        again.load_state_dict(loaded, BOUNDS)
        assert again.dropped_stale == 2 and again.state_dict() == state
        assert again.take(2, current_version=9, max_staleness=1)[1].responses[0].episode == episode


@pytest.mark.parametrize("spoil, named", [
    (lambda s: s["groups"][0]["responses"][0].update(token_versions=[1]), "other counts of versions"),
    (lambda s: s["groups"][0]["responses"][0].update(token_ids=[-1, 2]), r"token_ids holds values outside"),
    (lambda s: s["groups"][0].update(prompt=[1]), r"prompt is list, not dict"),
    (lambda s: s["groups"][0]["responses"][0].update(episode={"prompt_ids": "x"}), "prompt_ids is str"),
    (lambda s: s.update(dropped_stale=-1), "dropped_stale=-1"),
    (lambda s: s["groups"].extend(s["groups"] * 2), "more than this buffer's capacity 2"),
])
def test_a_bad_state_is_refused_naming_it_and_changes_nothing(spoil, named):
    buffer = TrajectoryBuffer(capacity=2)
    buffer.put(group(0, (1, 2)))
    state = json.loads(json.dumps(buffer.state_dict()))
    spoil(state)
    with pytest.raises(ValueError, match=named):
        buffer.load_state_dict(state, BOUNDS)
    assert len(buffer) == 1 and buffer.dropped_stale == 0


def test_producer_threads_and_a_consumer_pass_every_group_once():
    """Three producers put 40 groups each into a buffer of 4 (waiting for room) while the consumer takes 3 at a
    time (waiting for them): every group arrives once (fails on a lost or doubled group, or a deadlock)."""
    buffer = TrajectoryBuffer(capacity=4)
    producers = [threading.Thread(target=lambda p=p: [buffer.put(group(p * 100 + i, (0,)), timeout=None)
                                                      for i in range(40)]) for p in range(3)]
    for producer in producers:
        producer.start()
    taken = []
    while len(taken) < 120:
        groups = buffer.take(3, current_version=0, max_staleness=0, timeout=10.0)
        assert groups is not None, "the consumer waited 10 s for groups"
        taken += [g.index for g in groups]
    for producer in producers:
        producer.join(timeout=10.0)
    assert sorted(taken) == sorted(p * 100 + i for p in range(3) for i in range(40)) and len(buffer) == 0


def test_pending_groups_come_out_when_their_last_response_finishes_and_resume_from_their_state():
    pending = PendingGroups(n=2)
    pending.expect(0, index=17, prompt={"input_ids": [1]})
    pending.expect(1, index=4, prompt={"input_ids": [2]})
    first = Response(1, [5], [-0.1], token_versions=(0,))
    assert pending.add([first]) == []
    resumed = PendingGroups(n=2)
    resumed.load_state_dict(json.loads(json.dumps(pending.state_dict())), BOUNDS)
    second = Response(1, [6, 7], [-0.2, -0.3], token_versions=(0, 1))
    for gatherer in (pending, resumed):
        (done,) = gatherer.add([second])
        assert (done.index, done.responses, done.oldest_version, done.newest_version) == (4, (first, second), 0, 1)
        assert len(gatherer) == 1
    with pytest.raises(ValueError, match=r"prompts \[9\] that were never expected"):
        pending.add([Response(9, [1], token_versions=(0,))])


def test_staleness_metrics_count_each_masked_token_by_how_many_versions_old_it_is():
    versions = torch.tensor([[5, 5, 4, -1], [3, 5, -1, -1]])
    mask = (versions >= 0).long()
    metrics = staleness_metrics(versions, 5, mask)
    assert metrics == pytest.approx({"async/staleness_mean": 3 / 5, "async/staleness_max": 2.0,
                                     "async/stale_token_share": 2 / 5, "async/staleness_hist/0": 3 / 5,
                                     "async/staleness_hist/1": 1 / 5, "async/staleness_hist/2": 1 / 5})
    assert staleness_metrics(versions, 5, torch.zeros_like(mask))["async/staleness_max"] == 0.0
    with pytest.raises(ValueError, match="no version or one from the future"):
        staleness_metrics(versions, 4, mask)
    with pytest.raises(ValueError, match="no version or one from the future"):
        staleness_metrics(versions, 5, torch.ones_like(mask))
