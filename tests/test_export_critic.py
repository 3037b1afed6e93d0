"""Critic export: a critic trained at TP2 x PP2, saved with `save_role_weights` and exported, loads as
transformers' `*ForTokenClassification` with one label whose per-token values equal the critic's
`compute_values`, for a tied-embedding Qwen2 and an untied Llama (one torchrun launch of 4 processes).
The role's own plumbing (manifest field, the head's slots) is checked without processes.
"""
import json
import os
from pathlib import Path

import pytest
import torch

from verl_mega.parallel.spawn import run_torchrun

TP, PP = 2, 2
FAMILIES = {"qwen2": "Qwen2ForTokenClassification", "llama": "LlamaForTokenClassification"}


@pytest.mark.parametrize("family", FAMILIES)
def test_critic_slots_replace_the_lm_head_by_the_value_head(tiny_models, family):
    from verl_mega.checkpoint.roles import head_rules
    from verl_mega.models import load_hf_model_config
    from verl_mega.models.sharding import rank_slots

    cfg, spec = load_hf_model_config(tiny_models[family])
    last_stage = {role: {slot.local_name: slot.hf_names for slot in rank_slots(cfg, spec, 1, 2, head_rules=head_rules(role))}
                  for role in ("actor", "critic")}
    assert "output_layer.weight" in last_stage["actor"]
    assert last_stage["critic"]["output_layer.weight"] == ("score.weight",)
    assert last_stage["critic"]["output_layer.bias"] == ("score.bias",)
    backbone = {name: hf for name, hf in last_stage["actor"].items() if name != "output_layer.weight"}
    assert backbone.items() <= last_stage["critic"].items()


def test_manifest_role_defaults_to_actor_and_unknown_roles_are_refused(tiny_models, tmp_path):
    from verl_mega.checkpoint.manifest import MANIFEST_NAME, Manifest
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore

    ckpt = tmp_path / "ckpt"
    convert_hf_to_mcore(tiny_models["qwen2"], ckpt)
    manifest_path = ckpt / MANIFEST_NAME
    data = json.loads(manifest_path.read_text())
    del data["role"]  # as written before manifests had one
    manifest_path.write_text(json.dumps(data))
    assert Manifest.read(ckpt).role == "actor"
    manifest_path.write_text(json.dumps({**data, "role": "reward"}))
    with pytest.raises(ValueError, match="role must be one of actor, critic"):
        Manifest.read(ckpt)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> (HF folder of the exported critic, the worker's batch and values)."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("critic_export")
    ckpts = []
    for family in FAMILIES:
        hf_dir = make_tiny_hf_model(root / "hf" / family, family, num_hidden_layers=2)
        convert_hf_to_mcore(hf_dir, root / "ckpt" / family, tp=TP, pp=PP)
        ckpts.append(root / "ckpt" / family)
    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": ":".join(filter(None, [tests_dir, str(Path(tests_dir).parent),
                                                      *os.environ.get("PYTHONPATH", "").split(":")]))}
    run_torchrun(TP * PP, "tests.workers.critic_export_worker", [str(TP), str(PP), str(root / "out"), *map(str, ckpts)], env=env)
    result = {"out": root / "out"}
    for family in FAMILIES:
        out = root / "out" / family
        hf_out = convert_mcore_to_hf(out / "critic", root / "exported" / family)
        result[family] = (hf_out, torch.load(out / "values.pt"))
    return result


@pytest.mark.slow
def test_cli_exports_a_run_folders_final_critic_and_refuses_a_role_mismatch(exported, tmp_path, capsys):
    from verl_mega.cli import main as cli
    from verl_mega.run.folder import RunFolder

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    RunFolder(run_dir).final_weights("critic").symlink_to(exported["out"] / "qwen2" / "critic")
    assert cli(["export", "--ckpt", str(run_dir), "--role", "critic", "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [FAMILIES["qwen2"]]
    final_critic = RunFolder(run_dir).final_weights("critic")
    assert cli(["export", "--ckpt", str(final_critic), "--out", str(tmp_path / "hf_actor")]) == 2
    assert "pass --role critic" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_exported_critic_is_a_one_label_token_classifier(exported, family):
    from safetensors import safe_open

    hf_out, _ = exported[family]
    config = json.loads((hf_out / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[family]]
    assert config["tie_word_embeddings"] is False
    names = set()
    for path in hf_out.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            names |= set(f.keys())
    assert {"score.weight", "score.bias", "model.embed_tokens.weight"} <= names
    assert not any(name.startswith("lm_head") for name in names)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_values_match_the_critic(exported, family):
    from transformers import AutoModelForTokenClassification

    hf_out, saved = exported[family]
    batch, values = saved["batch"], saved["values"]
    model = AutoModelForTokenClassification.from_pretrained(hf_out, dtype=torch.float32).eval()
    assert model.num_labels == 1
    assert torch.count_nonzero(model.score.weight) > 0  # the update step moved the zero-initialised head
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    response_length = batch["responses"].shape[1]
    hf_values = logits[:, -response_length - 1:-1, 0]
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(hf_values[mask], values[mask], rtol=0, atol=1e-5)
