"""Families declared outside the package: the docs' InternLM2-style example, plugins, refusals."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from verl_mega.checkpoint.manifest import Manifest
from verl_mega.checkpoint.safetensors_io import SafetensorsReader, SafetensorsWriter
from verl_mega.cli import main as cli
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf
from verl_mega.converters.verify import verify_checkpoints
from verl_mega.models import HFModelConfig

from .test_convert import assert_same_tensors

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE = "internlm2_family:SPEC"


@pytest.fixture
def example_importable(monkeypatch):
    """The example module importable here and in the torchrun workers, as a user's PYTHONPATH makes it."""
    import os

    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")])))


def internlm2_style_copy(llama_dir: Path, out: Path) -> Path:
    """The tiny Llama with InternLM2's names: q/k/v fused per query group as `wqkv`, w1/w2/w3, ... ."""
    cfg = HFModelConfig.from_dict(json.loads((llama_dir / "config.json").read_text()))
    reader = SafetensorsReader(llama_dir)
    renames = {"model.embed_tokens.": "model.tok_embeddings.", "lm_head.": "output.", "self_attn.o_proj.": "attention.wo.",
               "input_layernorm.": "attention_norm.", "post_attention_layernorm.": "ffn_norm.",
               "mlp.gate_proj.": "feed_forward.w1.", "mlp.down_proj.": "feed_forward.w2.", "mlp.up_proj.": "feed_forward.w3."}
    out.mkdir()
    writer = SafetensorsWriter(out, 2 * 1024**3)
    for name in reader.names():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            groups = [reader.read(name.replace("q_proj", p)).unflatten(0, (cfg.num_kv_heads, -1))
                      for p in ("q_proj", "k_proj", "v_proj")]
            writer.add(name.replace("self_attn.q_proj", "attention.wqkv"), torch.cat(groups, dim=1).flatten(0, 1))
            continue
        for old, new in renames.items():
            name_out = name.replace(old, new)
            if name_out != name:
                break
        writer.add(name_out, reader.read(name))
    writer.close()
    config = json.loads((llama_dir / "config.json").read_text())
    config.update(model_type="internlm2", architectures=["InternLM2ForCausalLM"])
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def internlm2_dir(tiny_models, tmp_path_factory):
    return internlm2_style_copy(tiny_models["llama"], tmp_path_factory.mktemp("internlm2") / "hf")


def test_docs_show_the_example_verbatim_in_at_most_20_lines():
    example = (EXAMPLES / "internlm2_family.py").read_text()
    assert len(example.splitlines()) <= 20
    assert f"```python\n{example}```" in (ROOT / "docs" / "adding-a-family.md").read_text()


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_example_round_trip_is_bit_exact_and_recorded(internlm2_dir, tmp_path, example_importable, tp, pp):
    assert cli(["convert", "hf-to-mcore", "--hf", str(internlm2_dir), "--out", str(tmp_path / "ckpt"), "--tp", str(tp),
                "--pp", str(pp), "--family-spec", EXAMPLE]) == 0
    manifest = Manifest.read(tmp_path / "ckpt")
    assert (manifest.family, manifest.family_spec) == ("internlm2", EXAMPLE)
    assert cli(["convert", "mcore-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    assert_same_tensors(internlm2_dir, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["InternLM2ForCausalLM"]


@pytest.mark.slow
def test_example_logit_parity_with_transformers_llama_on_the_original(tiny_models, internlm2_dir, tmp_path,
                                                                      example_importable):
    convert_hf_to_mcore(internlm2_dir, tmp_path / "ckpt", tp=2, pp=2, family_spec=EXAMPLE)
    [parity] = verify_checkpoints([(tiny_models["llama"], tmp_path / "ckpt")])
    assert parity.passed and parity.max_abs <= 1e-4, parity.describe()


def test_plan_takes_the_family_spec(internlm2_dir, example_importable, capsys):
    assert cli(["plan", "--hf", str(internlm2_dir), "--train-tp", "2", "--train-pp", "2", "--dp", "1",
                "--rollout-tp", "1", "--family-spec", EXAMPLE]) == 0
    assert "rank" in capsys.readouterr().out


def test_installed_plugin_is_found_by_model_type_and_recorded(internlm2_dir, tmp_path, monkeypatch):
    site = tmp_path / "site"
    dist_info = site / "internlm2_plugin-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: internlm2-plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[verl_mega.families]\ninternlm2 = {EXAMPLE}\n")
    shutil.copy(EXAMPLES / "internlm2_family.py", site / "internlm2_family.py")
    monkeypatch.syspath_prepend(str(site))
    manifest = convert_hf_to_mcore(internlm2_dir, tmp_path / "ckpt")
    assert manifest.family_spec == EXAMPLE
    convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert_same_tensors(internlm2_dir, tmp_path / "hf")


# --- refusals ----------------------------------------------------------------------------------------


def test_unknown_type_points_at_the_mechanism(internlm2_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli(["convert", "hf-to-mcore", "--hf", str(internlm2_dir), "--out", str(out)]) == 2
    message = capsys.readouterr().err
    assert "model_type 'internlm2' is not supported" in message and "llama" in message
    assert "--family-spec package.module:SPEC" in message and "verl_mega.families" in message
    assert not out.exists()


def test_recorded_spec_that_cannot_be_imported_is_refused_by_name(internlm2_dir, tmp_path, example_importable,
                                                                  capsys):
    convert_hf_to_mcore(internlm2_dir, tmp_path / "ckpt", family_spec=EXAMPLE)
    manifest_path = tmp_path / "ckpt" / "verl_mega_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "family_spec": "moved_away.internlm2:SPEC"}))
    out = tmp_path / "hf"
    assert cli(["export", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out)]) == 2
    assert "family spec 'moved_away.internlm2:SPEC' cannot be imported" in capsys.readouterr().err
    assert not out.exists()
    assert cli(["export", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--family-spec", EXAMPLE]) == 0
    assert_same_tensors(internlm2_dir, out)


@pytest.mark.parametrize("reference, message", [
    ("internlm2_family", "must be written package.module:NAME"),
    ("internlm2_family:NOPE", "internlm2_family.NOPE is not a verl_mega FamilySpec"),
    ("json:dumps", "json.dumps is not a verl_mega FamilySpec"),
    ("no_such_package.spec:SPEC", "no module named 'no_such_package'"),
])
def test_bad_spec_references_are_refused(internlm2_dir, tmp_path, example_importable, capsys, reference, message):
    out = tmp_path / "out"
    assert cli(["convert", "hf-to-mcore", "--hf", str(internlm2_dir), "--out", str(out), "--family-spec", reference]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_spec_for_another_model_type_is_refused(tiny_models, tmp_path, example_importable, capsys):
    out = tmp_path / "out"
    assert cli(["convert", "hf-to-mcore", "--hf", str(tiny_models["llama"]), "--out", str(out),
                "--family-spec", EXAMPLE]) == 2
    assert "declares model types internlm2, but config.json says model_type 'llama'" in capsys.readouterr().err


def test_spec_module_inside_the_model_folder_is_never_imported(internlm2_dir, tmp_path, monkeypatch, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(internlm2_dir, hf)
    canary = tmp_path / "imported"
    (hf / "sneaky_family.py").write_text(f"open({str(canary)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(hf))
    out = tmp_path / "out"
    assert cli(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out), "--family-spec", "sneaky_family:SPEC"]) == 2
    assert "never imported from a model or checkpoint folder" in capsys.readouterr().err
    assert not canary.exists() and not out.exists()


@pytest.mark.parametrize("config", [
    {"model_type": "bert", "architectures": ["BertForMaskedLM"]},
    {"model_type": "t5", "is_encoder_decoder": True},
    {"model_type": "llava", "text_config": {"model_type": "llama"}, "vision_config": {}},
    {"model_type": "whatever", "architectures": ["WhateverForConditionalGeneration"]},
])
def test_non_decoders_are_refused_whatever_the_spec_says(internlm2_dir, tmp_path, monkeypatch, capsys, config):
    module = tmp_path / "specs" / f"claims_{config['model_type']}.py"
    module.parent.mkdir()
    module.write_text(
        (EXAMPLES / "internlm2_family.py").read_text().replace('model_types=("internlm2",)', f'model_types=({config["model_type"]!r},)'))
    monkeypatch.syspath_prepend(str(module.parent))
    hf = tmp_path / "hf"
    shutil.copytree(internlm2_dir, hf)
    (hf / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()), **config}))
    out = tmp_path / "out"
    assert cli(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out), "--family-spec",
                f"claims_{config['model_type']}:SPEC"]) == 2
    assert "only decoder-only language models are supported, whatever a family spec declares" in capsys.readouterr().err
    assert not out.exists()


def test_training_config_names_the_family_spec_key(internlm2_dir, tmp_path):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "copy: 1", "reward_model": {"ground_truth": "1"}}) + "\n")
    config = load_config(None, [f"model.hf_path={internlm2_dir}", f"data.train_files=[{prompts}]",
                                "model.family_spec=moved_away:SPEC", "data.batch_size=2", "actor.mini_batch_size=2",
                                "critic.mini_batch_size=2"])
    with pytest.raises(ConfigError, match="model.family_spec: family spec 'moved_away:SPEC' cannot be imported"):
        preflight_check(config, world_size=1)
