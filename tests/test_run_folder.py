"""verl_mega.run.RunFolder names every path of a run folder: each one under the root, the names the on-disk format
users rely on, and a real run writes nothing it does not name."""
import inspect
import os
import subprocess
import sys

import pytest

from verl_mega.demo import EXAMPLES
from verl_mega.run import RunFolder
from verl_mega.run.folder import layout_name

LAYOUT = layout_name(1, 2, 1)
# Every public method of RunFolder, with arguments, and the path it names (relative to the root).
METHODS = {
    "step": ((12,), "checkpoints/step_000012"),
    "final_weights": (("critic",), "final_critic"),
    "initial_weights": (("actor", LAYOUT), "initial_actor_tp1_pp2_ep1"),
    "teacher_weights": ((LAYOUT, "0123456789abcdef" * 4), "initial_teacher_tp1_pp2_ep1_0123456789abcdef"),
    "profile_trace": ((3, 1), "profile/step_000003_rank1.pt.trace.json"),
}
PROPERTIES = {
    "config": "config.yaml", "provenance": "provenance.json", "lock": ".lock", "metrics": "metrics.jsonl",
    "generations": "generations.jsonl", "plot": "metrics.png", "tensorboard": "tensorboard",
    "checkpoints": "checkpoints", "mirror_pending": ".mirror_pending",
    "reference_logprobs": "reference_logprobs.safetensors",
}
LISTINGS = {"initial_conversions"}  # methods that list what is there rather than name one path


def named_paths(folder: RunFolder) -> dict[str, str]:
    properties = {name: getattr(folder, name) for name, _ in inspect.getmembers(RunFolder, inspect.isdatadescriptor)
                  if isinstance(getattr(RunFolder, name), property)}
    methods = {name: getattr(folder, name)(*METHODS[name][0]) for name, _ in inspect.getmembers(
        RunFolder, inspect.isfunction) if not name.startswith("_") and name not in LISTINGS}
    return {name: path.relative_to(folder.root).as_posix() for name, path in {**properties, **methods}.items()}


def test_every_path_is_under_the_root_distinct_and_spelled_as_on_disk(tmp_path):
    paths = named_paths(RunFolder(tmp_path / "run"))  # relative_to raises for a path outside the root
    assert paths == {**PROPERTIES, **{name: path for name, (_, path) in METHODS.items()}}
    assert len(set(paths.values())) == len(paths)


def test_a_run_folder_is_a_value_over_its_root(tmp_path):
    assert RunFolder(str(tmp_path)) == RunFolder(tmp_path) and RunFolder(str(tmp_path)).root == tmp_path
    with pytest.raises(ValueError, match="role must be one of"):
        RunFolder(tmp_path).final_weights("reference")


def test_initial_conversions_lists_each_layout_of_one_role(tmp_path):
    folder = RunFolder(tmp_path)
    for role, layout in (("actor", "tp1_pp1_ep1"), ("actor", LAYOUT), ("critic", LAYOUT)):
        folder.initial_weights(role, layout).mkdir()
    assert folder.initial_conversions("actor") == [folder.initial_weights("actor", "tp1_pp1_ep1"),
                                                   folder.initial_weights("actor", LAYOUT)]


@pytest.mark.slow
def test_a_real_run_writes_only_what_run_folder_names(tmp_path):
    """One process, two DPO steps on the tiny model with a checkpoint per step, a profiled step, tensorboard
    and the reference log-prob cache; then `verl-mega plot`. Every entry of the folder is a RunFolder path."""
    from verl_mega.data.synthetic import make_task_rows, preference_pairs
    from verl_mega.data.tables import write_rows
    from verl_mega.models.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(tmp_path / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    pairs = write_rows(preference_pairs(make_task_rows("copy", 32, seed=0, max_digits=2)), tmp_path / "pairs.jsonl")
    folder = RunFolder(tmp_path / "run")
    train = [sys.executable, "-m", "verl_mega.cli", "dpo", "--config", str(EXAMPLES / "dpo_demo.yaml"),
             f"model.hf_path={hf}", f"data.train_files=[{pairs}]", f"trainer.run_dir={folder.root}",
             "data.batch_size=4", "actor.mini_batch_size=4", "actor.micro_batch_size=2", "trainer.total_steps=2",
             "trainer.save_every=1", "trainer.keep_last=5", "trainer.profile_steps=[1]", "trainer.tensorboard=true",
             "algorithm.cache_reference_logprobs=true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for command in (train, [sys.executable, "-m", "verl_mega.cli", "plot", str(folder.root)]):
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        assert result.returncode == 0, result.stderr[-3000:]

    initial = folder.initial_weights("actor", layout_name(1, 1, 1))
    expected = {folder.config, folder.provenance, folder.lock, folder.metrics, folder.plot, folder.tensorboard,
                folder.checkpoints, folder.final_weights("actor"), initial, folder.profile_trace(1, 0).parent,
                folder.reference_logprobs}
    assert set(folder.root.iterdir()) == expected
    assert sorted(folder.checkpoints.iterdir()) == [folder.step(1), folder.step(2)]
    assert list(folder.profile_trace(1, 0).parent.iterdir()) == [folder.profile_trace(1, 0)]
    assert folder.initial_conversions("actor") == [initial]
