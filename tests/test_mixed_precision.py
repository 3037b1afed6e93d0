"""bf16 (and fp16) end to end: the optimizer's fp32 main weights through the dist checkpoint, a PPO run that
saves, resumes at another layout and exports, and the config's dtype rules.

Every parameter follows the model dtype (verl_mega.models.builder says why), so a bf16 checkpoint holds bf16
model tensors and, beside them, the optimizer's fp32 main weights and Adam moments: resuming is exact.
"""
import json
import os
from pathlib import Path

import pytest
import torch

from verl_mega.parallel.spawn import run_torchrun

from trainer_runs import RUNS, records

DP = 2


@pytest.fixture(scope="module")
def state_round_trip(tmp_path_factory):
    """'{dtype}_{kind}' -> the worker's record (see tests/workers/mixed_precision_worker.py); one launch of 2 processes."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("mixed_precision")
    hf_dir = make_tiny_hf_model(root / "hf", "qwen3", num_hidden_layers=2)  # q/k norms too
    convert_hf_to_mcore(hf_dir, root / "ckpt", dtype="fp32")  # loaded in bf16 / fp16: cast on load
    out = root / "out"
    out.mkdir()
    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": ":".join(filter(None, [tests_dir, str(Path(tests_dir).parent),
                                                      *os.environ.get("PYTHONPATH", "").split(":")]))}
    run_torchrun(DP, "tests.workers.mixed_precision_worker", [str(root / "ckpt"), str(out)], env=env)
    return {path.stem: torch.load(path) for path in out.glob("*.pt")}


CASES = ["bf16_plain", "bf16_distributed", "fp16_plain", "fp16_distributed"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_every_parameter_norms_included_follows_the_model_dtype(state_round_trip, case):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.split("_")[0]]
    dtypes = state_round_trip[case]["param_dtypes"]
    assert any("layernorm" in name for name in dtypes)
    assert {name for name, found in dtypes.items() if found != dtype} == set()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fp32_main_weights_and_the_next_update_round_trip_bitwise(state_round_trip, case):
    record = state_round_trip[case]
    assert all(main.dtype == torch.float32 for main in record["saved_main"])
    assert len(record["loaded_main"]) == len(record["saved_main"])
    assert all(torch.equal(a, b) for a, b in zip(record["loaded_main"], record["saved_main"]))
    saved_scale, loaded_scale = record["loss_scale"]
    assert loaded_scale == saved_scale  # fp16's dynamic loss scale resumes too (bf16: a constant 1)
    assert record["resumed"]["metrics"] == record["straight"]["metrics"]
    straight, resumed = record["straight"]["weights"], record["resumed"]["weights"]
    assert [name for name in straight if not torch.equal(straight[name], resumed[name])] == []


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", RUNS)
def test_bf16_run_saves_resumes_at_another_layout_and_exports(bf16_layout_runs, tmp_path, algorithm):
    """tests/trainer_runs.py's bf16 run at (2, 2, 2), resumed at (2, 1, 2) (the ppo_gae one shared with
    tests/test_resume.py): fp32 main weights and moments beside bf16 model tensors, then an export in bf16."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from verl_mega.cli import main as cli

    shared = bf16_layout_runs(algorithm)
    run_dir = shared["run_dir"]
    (saved,) = shared["first_checkpoints"]
    stored = shared["stored_dtypes"]
    assert stored["decoder.final_layernorm.weight"] == torch.bfloat16
    assert stored["optimizer.state.fp32_param.decoder.final_layernorm.weight"] == torch.float32
    assert stored["optimizer.state.exp_avg.decoder.final_layernorm.weight"] == torch.float32

    assert f"resumed from {saved} at step 2" in shared["resumed_stdout"]
    assert sorted(records(run_dir)) == [1, 2, 3, 4]
    assert all(all(map(_finite, record.values())) for record in records(run_dir).values())

    roles = {"actor": AutoModelForCausalLM} | ({"critic": AutoModelForTokenClassification} if algorithm == "ppo_gae" else {})
    assert (run_dir / "final_critic").exists() == ("critic" in roles)
    for role, auto_class in roles.items():
        manifest = json.loads((run_dir / f"final_{role}" / "verl_mega_manifest.json").read_text())
        assert manifest["dtype"] == "bf16"
        exported = tmp_path / f"hf_{role}"
        assert cli(["export", "--ckpt", str(run_dir), "--role", role, "--out", str(exported)]) == 0
        with safe_open(exported / "model.safetensors", "pt") as tensors:
            assert {tensors.get_tensor(name).dtype for name in tensors.keys()} == {torch.bfloat16}
        model = auto_class.from_pretrained(exported)
        assert next(model.parameters()).dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits.float()).all()


def _finite(value) -> bool:
    return not isinstance(value, float) or value == value and abs(value) != float("inf")


@pytest.mark.parametrize("overrides, message", [
    (["model.dtype=fp8"], "model.dtype 'fp8' is unknown; known: fp32, bf16, fp16"),
    (["rollout.dtype=half"], "rollout.dtype 'half' is unknown; known: auto, fp32, bf16, fp16"),
    (["model.dtype=bf16", "rollout.engine=embedded", "rollout.dtype=fp32"],
     "rollout.dtype=fp32 with rollout.engine=embedded: the embedded engine runs in model.dtype (bf16)"),
])
def test_impossible_dtype_settings_are_refused_before_start_up(overrides, message):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    config = load_config(None, ["model.hf_path=unused", *overrides])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        preflight_check(config, world_size=1, check_files=False)


@pytest.mark.parametrize("engine, dtype, model_dtype, expected", [
    ("embedded", "auto", "bf16", "bf16"), ("embedded", "auto", "fp32", "fp32"), ("vllm", "auto", "fp32", "bf16"),
    ("vllm", "fp16", "bf16", "fp16"), ("embedded", "fp32", "fp32", "fp32"),
])
def test_rollout_dtype_follows_the_engine(engine, dtype, model_dtype, expected):
    from verl_mega.rollout.factory import resolve_rollout_dtype

    assert resolve_rollout_dtype(engine, dtype, model_dtype) == expected


def test_a_library_error_is_a_bug_with_a_traceback_and_ours_a_user_error():
    """The first bf16 save failed inside megatron with a ValueError that the trainer printed as a user error.
    Only UserError becomes a one-line exit 2 (trainer.main); a library's ValueError is not one."""
    from verl_mega.config import load_config
    from verl_mega.config.errors import UserError
    from verl_mega.trainer.preflight import preflight_check

    with pytest.raises(ValueError) as library:
        json.loads("{")
    assert not isinstance(library.value, UserError)
    with pytest.raises(UserError):
        preflight_check(load_config(None, ["model.hf_path=unused", "model.dtype=fp8"]), world_size=1, check_files=False)
