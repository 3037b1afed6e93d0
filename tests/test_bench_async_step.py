"""bench/async_step.py's figures from a run's metrics, computed by hand here (no timing)."""
from bench.async_step import summarise
from bench.vs_trl import SEQUENCES_PER_STEP


def step(seconds: float, reward: float, **timing) -> dict:
    return {"perf/step_seconds": seconds, "response/length_mean": 10.0, "reward/mean": reward,
            **{f"timing/{stage}": value for stage, value in timing.items()}}


def test_disaggregated_idle_shares_come_from_the_wait_and_the_rollout_ranks_work():
    """The first step is warm-up and left out of the medians; could fail if the sides' shares were swapped."""
    records = [step(9.0, 0.1, rollout_wait=9.0, rollout_ranks_busy=1.0),
               {**step(4.0, 0.2, rollout_wait=1.0, rollout_ranks_busy=3.0), "async/staleness_hist/1": 1.0},
               {**step(4.0, 0.3, rollout_wait=1.0, rollout_ranks_busy=3.0), "async/staleness_hist/0": 0.5,
                "async/staleness_hist/1": 0.5}]
    figures = summarise(records, colocated=False)
    assert figures["step"] == 4.0 and figures["tokens_per_second"] == 10.0 * SEQUENCES_PER_STEP / 4.0
    assert (figures["train_idle"], figures["rollout_idle"]) == (0.25, 0.25)
    assert figures["staleness"] == {0: 0.5 / 3, 1: 1.5 / 3} and figures["reward"] == [0.1, 0.2, 0.3]


def test_colocated_sides_take_turns_and_sync_is_never_stale():
    figures = summarise([step(2.0, 0.0, rollout=1.5, transition=0.5), step(2.0, 0.0, rollout=1.0)], colocated=True)
    assert (figures["train_idle"], figures["rollout_idle"]) == (0.5, 0.5) and figures["staleness"] == {0: 1.0}


def test_each_sides_seconds_and_the_limit_the_sides_alone_allow():
    """Could fail if the training side's busy time kept its wait, or the limit counted the push twice."""
    from bench.async_step import overlap_limit

    records = [step(10.0, 0.0, transition=1.0, rollout_wait=6.0, rollout_ranks_busy=7.0, rollout_ranks_cpu=6.5)] * 2
    figures = summarise([{**r, "perf/step_cpu_seconds": 3.5} for r in records], colocated=False)
    assert figures["seconds"] == {"push": 1.0, "train_busy": 4.0, "train_cpu": 3.5, "rollout_busy": 7.0,
                                  "rollout_cpu": 6.5}
    assert overlap_limit(figures) == (1.0 + 6.0) / 10.0
