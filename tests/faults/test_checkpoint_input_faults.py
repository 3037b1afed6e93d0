"""A converted checkpoint given to a run or to verify that is not the model, layout or shapes it claims: refused
in one line naming the checkpoint and what differs (before any process group where the pre-flight check can see
it, by the loading rank otherwise), never a traceback from a rank."""
from __future__ import annotations

import pytest
import torch

from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.trainer import main as trainer_main

from .convert_tools import fault_models, run  # noqa: F401
from .test_run_faults import inputs, refused_in_process, tiny_run  # noqa: F401

FC2 = "decoder.layers.0.mlp.linear_fc2.weight"


@pytest.fixture(scope="module")
def conversions(inputs, fault_models, tmp_path_factory):
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("ckpt_inputs")
    deeper = make_tiny_hf_model(root / "deeper", "qwen2", vocab_size=64, num_hidden_layers=4)
    made = {"llama": convert_hf_to_mcore(fault_models["llama"], root / "llama") and root / "llama",
            "deeper-qwen2": convert_hf_to_mcore(deeper, root / "deeper-ckpt") and root / "deeper-ckpt",
            "tp2": convert_hf_to_mcore(inputs["hf"], root / "tp2", tp=2) and root / "tp2",
            "same": convert_hf_to_mcore(inputs["hf"], root / "same") and root / "same"}
    return made


@pytest.mark.parametrize("which, words", [
    ("llama", ("is a llama checkpoint", "is a qwen2 model", "model.actor_ckpt")),
    ("deeper-qwen2", ("is a qwen2 checkpoint", "num_layers 4 vs 2")),
    ("tp2", ("written for tp=2", "parallel.tp=1", "torch_dist")),
])
def test_an_actor_checkpoint_of_another_model_or_layout_is_refused_before_start(capsys, inputs, tmp_path,
                                                                                conversions, which, words):
    err = refused_in_process(capsys, inputs, tmp_path, [f"model.actor_ckpt={conversions[which]}"])
    assert all(word in err for word in words), err
    assert err.count("\n") <= 3, err  # the pre-flight report: its heading and one line per problem


def _wrong_shape_copy(source, target):
    import shutil

    shutil.copytree(source, target)
    (shard,) = target.glob("iter_*/mp_rank_*/model_optim_rng.pt")
    payload = torch.load(shard, weights_only=True)
    payload["model"][FC2] = payload["model"][FC2][:, :16].clone()
    torch.save(payload, shard)
    return target


def test_a_shard_of_the_wrong_shape_is_one_line_from_the_training_rank(capsys, inputs, tmp_path, conversions):
    ckpt = _wrong_shape_copy(conversions["same"], tmp_path / "ckpt")
    code = trainer_main.main(["--config", str(inputs["config"]), *tiny_run(inputs, tmp_path / "run"),
                              f"model.actor_ckpt={ckpt}"])
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if "Warning" not in line and "warnings.warn" not in line]
    assert code == 2 and len(lines) == 1, "\n".join(err)
    assert FC2 in lines[0] and "[64, 16]" in lines[0], lines[0]


@pytest.mark.slow
def test_a_shard_of_the_wrong_shape_is_one_line_from_verify(capsys, inputs, tmp_path, conversions):
    ckpt = _wrong_shape_copy(conversions["same"], tmp_path / "ckpt")
    code, err = run(["convert", "verify", "--hf", inputs["hf"], "--ckpt", ckpt], capsys)
    lines = [line for line in err.strip().splitlines() if "Warning" not in line and "warnings.warn" not in line]
    assert code == 2 and len(lines) == 1, err
    assert FC2 in lines[0], lines[0]
