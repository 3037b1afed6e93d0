"""The memory planner against measurement (bench/planner_grid): per rank, the bytes of parameters, gradients and
optimizer state, what `actor.offload` leaves on the device in the rollout window, and one micro-batch's
activations, within 10 % of `planning.memory`'s prediction. One rank in process here; the 2-rank launch of the
grid is slow."""
from __future__ import annotations

import pytest

from bench.planner_grid import GRID, GridLayout, measure, predicted, prepare, ratios, run_grid


@pytest.mark.parametrize("layout", [GridLayout(1, offload=(True, True, True)),
                                    GridLayout(1, dtype="fp32", distributed=True, recompute="full")],
                         ids=lambda layout: layout.name())
def test_one_rank_matches_the_planner_within_10_percent(one_rank, tmp_path, layout):
    hf, ckpts = prepare(tmp_path, [(1, 1)])
    row = {"measured": measure(layout, ckpts / "tp1pp1", hf), "predicted": predicted(layout, hf)}
    assert set(row["measured"]) == {"state", "window", "activations", "peak"}
    # Not the peak here: it counts every live tensor of the process, other tests' included (the grid's launch does).
    for key in ("state", "window", "activations"):
        assert ratios(row)[key] == pytest.approx(1, abs=0.1), (key, row)


def test_the_grid_spans_at_least_12_layouts_of_2_and_4_ranks():
    assert len(GRID) >= 12 and {layout.world for layout in GRID} == {2, 4}
    assert {(layout.tp, layout.pp) for layout in GRID} >= {(1, 1), (2, 1), (1, 2), (2, 2)}
    assert any(layout.vpp > 1 for layout in GRID)


@pytest.mark.slow
def test_the_2_rank_grid_matches_the_planner_within_10_percent(tmp_path):
    rows = run_grid([2], tmp_path)
    assert len(rows) == sum(layout.world == 2 for layout in GRID)
    for row in rows:
        for key, ratio in ratios(row).items():
            assert ratio == pytest.approx(1, abs=0.1), (row["layout"], key, row)
