"""Session fixtures shared by the test files: tiny HF models and the layout grids' launches, built once."""
import fcntl
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The processes the tests start import this checkout and the tests' helpers (`tests.workers.*`, `trainer_runs`) by
# PYTHONPATH: the project starts its children without the working folder on their path (parallel.safe_path).
_ROOT = Path(__file__).resolve().parent.parent
os.environ["PYTHONPATH"] = os.pathsep.join([str(_ROOT), str(_ROOT / "tests"),
                                            *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@pytest.fixture(autouse=True)
def _signal_handlers_given_back():
    """Signal handlers are the process's: a test that runs the trainer's entry point in-process (which ignores
    Ctrl-C once all is saved) or a launcher would otherwise hand its handlers to the next test of its xdist worker."""
    handlers = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen2_moe", "gemma2", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """model_type -> folder of a tiny random HF model (with the tiny tokenizer), built once per session."""
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {family: make_tiny_hf_model(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def layout_grid(tmp_path_factory):
    """The folder of the layout grids' results (tests/layout_grid.py): three torchrun launches, once per test run,
    shared by tests/test_layout_invariance.py, test_offline_layout_invariance.py, test_update_passes.py,
    test_training_state.py and test_lora.py."""
    from layout_grid import run_layout_grid

    return built_once_per_run(tmp_path_factory, "layout_grid", run_layout_grid)


@pytest.fixture(scope="session")
def bf16_layout_runs(tmp_path_factory):
    """algorithm -> the record of tests/trainer_runs.py's bf16 run resumed at another layout, each run at most once
    per test run (built_once_per_run): tests/test_resume.py and tests/test_mixed_precision.py check the same
    ppo_gae run."""
    from trainer_runs import bf16_layout_change_run, layout_change_record, make_inputs

    def get(algorithm: str) -> dict:
        folder = built_once_per_run(tmp_path_factory, f"bf16_layout_run_{algorithm}",
                                    lambda folder: bf16_layout_change_run(make_inputs(folder), folder, algorithm))
        return layout_change_record(folder)

    return get


def built_once_per_run(tmp_path_factory, name, build):
    """The folder `name` that `build(folder)` fills, built once per test run. pytest-xdist's workers share the run's
    temp folder: the first worker to ask builds while the others wait on a lock, and a `done` file marks a finished
    build, so a worker never reads a half-built one (a failed build is cleared and tried again by the next worker,
    which then reports the failure itself)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / "done").touch()
    return folder


@pytest.fixture
def prompt_file(tmp_path):
    """Eight prompts of the copy task, for configs the pre-flight check reads."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"copy: {i}"}) for i in range(8)))
    return path


@pytest.fixture(scope="module")
def one_rank():
    """torch.distributed and megatron's parallel state over this process alone (TP = PP = 1), for a module's
    in-process tests of megatron models."""
    from verl_mega.parallel.state import destroy_parallel, init_parallel

    init_parallel(1, 1)
    yield
    destroy_parallel()


@pytest.fixture(scope="module")
def one_rank_world(tmp_path_factory):
    """A gloo world of this process alone, for the parts that gather or agree over the ranks (a module's tests)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('world') / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def student_and_teacher(tmp_path_factory):
    """Two tiny Qwen2 models of the same tokenizer and shape, different weights: a distillation's student and
    teacher."""
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("student_and_teacher")
    return tuple(make_tiny_hf_model(root / name, "qwen2", vocab_size=64, num_hidden_layers=2, seed=seed)
                 for name, seed in (("student", 0), ("teacher", 1)))
