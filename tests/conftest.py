"""Session fixtures shared by the test files: tiny HF models and the layout grids' launches, built once."""
import json
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen2_moe", "gemma2", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """model_type -> folder of a tiny random HF model (with the tiny tokenizer), built once per session."""
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {family: make_tiny_hf_model(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def layout_grid(tmp_path_factory):
    """The folder of the layout grids' results (tests/layout_grid.py): three torchrun launches, once per session,
    shared by tests/test_layout_invariance.py, test_offline_layout_invariance.py, test_update_passes.py and
    test_training_state.py."""
    from layout_grid import run_layout_grid

    return run_layout_grid(tmp_path_factory.mktemp("layout_grid"))


@pytest.fixture(scope="session")
def bf16_layout_runs(tmp_path_factory):
    """algorithm -> the record of tests/trainer_runs.py's bf16 run resumed at another layout, each run at most once
    per session: tests/test_resume.py and tests/test_mixed_precision.py check the same ppo_gae run."""
    from trainer_runs import bf16_layout_change_run, make_inputs

    root = tmp_path_factory.mktemp("bf16_layout_runs")
    setup = make_inputs(root)
    done = {}

    def get(algorithm: str) -> dict:
        if algorithm not in done:
            done[algorithm] = bf16_layout_change_run(setup, root / algorithm, algorithm)
        return done[algorithm]

    return get


@pytest.fixture
def prompt_file(tmp_path):
    """Eight prompts of the copy task, for configs the pre-flight check reads."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"copy: {i}"}) for i in range(8)))
    return path
