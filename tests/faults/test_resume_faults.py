"""Starting again on a run folder resumes the run it holds: a config that would train something else there
(other data, algorithm, batch sizes, model) is refused naming the keys that differ, and changes nothing in the
folder; the run's length, logging and layout may change, and `trainer.allow_config_change` lets a user go on."""
from __future__ import annotations

import pytest

from verl_mega.trainer import main as trainer_main

from .test_run_faults import inputs, snapshot, tiny_run  # noqa: F401


def _state(run_dir) -> dict:
    """The run folder's files but its lock (whose holder record every start rewrites)."""
    return {path: digest for path, digest in snapshot(run_dir).items() if not path.endswith("/.lock")}


def _train(inputs, run_dir, *overrides) -> int:
    return trainer_main.main(["--config", str(inputs["config"]), *tiny_run(inputs, run_dir), "trainer.total_steps=1",
                              "trainer.tensorboard=false", "trainer.progress_bar=false", *overrides])


@pytest.mark.slow
def test_a_resume_with_another_config_is_refused_naming_the_keys(inputs, tmp_path, capsys):
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows

    run_dir = tmp_path / "run"
    assert _train(inputs, run_dir) == 0
    other_data = write_rows(make_task_rows("copy", 16, seed=7, max_digits=2), tmp_path / "other.jsonl")
    before = _state(run_dir)
    capsys.readouterr()
    for changes, words in ([[f"data.train_files=[{other_data}]"], ("data.train_files", "other.jsonl")],
                           [["algorithm.adv_estimator=grpo", "critic.enable=false"],
                            ("algorithm.adv_estimator: 'gae' -> 'grpo'",)],
                           [["actor.optim.lr=0.5"], ("actor.optim.lr",)]):
        assert _train(inputs, run_dir, "trainer.total_steps=2", *changes) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(word in err for word in words), err
        assert "trainer.allow_config_change=true" in err and "total_steps" not in err, err
        assert _state(run_dir) == before, "a refused start changed the run folder"
    # Length, logging and micro-batching may change; and the user may say to go on.
    assert _train(inputs, run_dir, "trainer.total_steps=2", "trainer.log_format=json", "actor.micro_batch_size=2") == 0
    assert _train(inputs, run_dir, "trainer.total_steps=3", "actor.optim.lr=0.5",
                  "trainer.allow_config_change=true") == 0
