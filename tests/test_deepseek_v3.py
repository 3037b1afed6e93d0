"""DeepSeek-V3: multi-latent attention, sigmoid routing with the expert-bias correction, group-limited top-k.

Round trips and parity at (1,1), (2,1), (1,2), (2,2) in fp32, bf16 and fp16 run with the other families in
test_convert.py, and at TP2 x EP2 with the VARIANTS below (q_proj without a q LoRA rank, plain RoPE, one expert
group) in test_qwen2_moe.py's launch; here: the refusals of what megatron cannot reproduce, and that the tiny
model's parity would see a lost expert bias or a wrong RoPE layout.
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


@pytest.mark.parametrize("layer, converts", [(4, True), (5, False)])
def test_multi_token_prediction_layers_are_skipped(tiny_hf, tmp_path, layer, converts):
    """DeepSeek-V3's checkpoints carry `num_nextn_predict_layers` (here 1) layers after the last: not converted."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_hf, hf_dir)
    tensors = load_file(hf_dir / "model.safetensors")
    tensors[f"model.layers.{layer}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    if converts:
        convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")
    else:
        with pytest.raises(ValueError, match=f"tensor 'model.layers.{layer}.eh_proj.weight' is not part of a deepseek_v3"):
            convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")
