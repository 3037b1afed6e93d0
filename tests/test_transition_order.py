"""The memory order of the HybridEngine transition, per step and per validation pass: the training side's
memory (gradient buffers, optimizer state, allocator cache) is released before the rollout engine wakes its
weights and KV cache, and comes back after the engine sleeps."""
import json
import os
import subprocess
import sys

import pytest

from verl_mega.demo import EXAMPLES

# One training step or validation pass of one process, as the engine and the release context see it.
TRANSITION = ["release", "wake_up:weights", "load_weights", "wake_up:kv_cache"]
BACK = ["sleep", "restore"]


@pytest.mark.slow
def test_training_memory_is_released_before_the_engine_wakes_at_every_step(tmp_path):
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.models.tiny import make_tiny_hf_model

    hf = make_tiny_hf_model(tmp_path / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    train = write_rows(make_task_rows("copy", 16, seed=0, max_digits=2), tmp_path / "train.jsonl")
    val = write_rows(make_task_rows("copy", 3, seed=1, max_digits=2), tmp_path / "val.jsonl")
    out = tmp_path / "calls.json"
    result = subprocess.run(
        [sys.executable, "-m", "tests.transition_order_worker", str(out), "--config", str(EXAMPLES / "grpo_demo.yaml"),
         f"model.hf_path={hf}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
         f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=3", "trainer.val_every=2", "data.batch_size=4",
         "rollout.n=2", "actor.mini_batch_size=8", "actor.micro_batch_size=4", "trainer.tensorboard=false"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    calls = json.loads(out.read_text())

    passes, current = [], None
    for call in calls:
        if call in ("train_step", "validate"):
            current = [call]
            passes.append(current)
        else:
            current.append(call)
    # Validation before the first step, then steps 1..3 with validation after steps 2 and 3.
    assert [p[0] for p in passes] == ["validate", "train_step", "train_step", "validate", "train_step", "validate"]
    for number, (kind, *order) in enumerate(passes):
        generations = len(order) - len(TRANSITION) - len(BACK)
        assert order == TRANSITION + ["generate"] * generations + BACK and generations >= 1, (number, kind, order)
