"""Qwen3-MoE: q/k norms with routed experts and no shared expert, norm_topk_prob, dense layers; both spellings of
the experts (one tensor each, or transformers 5's stacks); parity at EP and a variant's round trip.

Round trips at (1,1), (2,1), (1,2), (2,2), logit parity at those layouts in three dtypes, and greedy decoding
against transformers run with the other families (tests/conftest.py's FAMILIES); EP parity beside Qwen2-MoE's
(tests/test_qwen2_moe.py), the HybridEngine with the MoE families (tests/test_hybrid_engine.py).
"""
import json

import pytest
import torch

from verl_mega.checkpoint import megatron_legacy
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf
from verl_mega.models import HFModelConfig, load_hf_model_config
from verl_mega.models.builder import architecture
from verl_mega.models.families import qwen3_moe
from verl_mega.models.tiny import make_tiny_hf_model

from .faults.convert_tools import assert_wrong_shape_refused, edit_tensors
from .test_convert import assert_same_tensors, hf_tensors

SIZES = dict(hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=12, num_experts=2, num_experts_per_tok=1, vocab_size=32)


@pytest.mark.parametrize("sparsity, expected", [
    (dict(mlp_only_layers=[1]), [True, False, True, True]),
    (dict(decoder_sparse_step=2, mlp_only_layers=[]), [False, True, False, True]),
    (dict(decoder_sparse_step=2, mlp_only_layers=[3]), [False, True, False, False]),
])
def test_moe_layers_are_the_ones_transformers_builds(sparsity, expected):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", **SIZES, **sparsity)
    model = AutoModelForCausalLM.from_config(config)
    built = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert built == expected == qwen3_moe.moe_layers(HFModelConfig.from_dict(config.to_dict()))


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_megatron_architecture_follows_the_config(norm_topk_prob):
    """Experts moe_intermediate_size wide and dense layers intermediate_size, q/k norms, head_dim 12 ≠ 16 / 2, no
    shared expert, and renormalised top-k weights exactly where norm_topk_prob says."""
    raw = {"model_type": "qwen3_moe", **SIZES, "mlp_only_layers": [1], "norm_topk_prob": norm_topk_prob}
    shape = architecture(HFModelConfig.from_dict(raw), qwen3_moe.SPEC)
    assert (shape["ffn_hidden_size"], shape["moe_ffn_hidden_size"], shape["kv_channels"]) == (32, 8, 12)
    assert shape["qk_layernorm"] is True and shape["add_qkv_bias"] is False
    assert shape["moe_layer_freq"] == [1, 0, 1, 1]
    assert shape["moe_router_pre_softmax"] is not norm_topk_prob
    assert not any("shared" in name for name in shape)


def test_qwen3_moe_config_names_the_family(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path / "hf", "qwen3_moe", tokenizer=False)
    config, family = load_hf_model_config(hf_dir)
    assert family is qwen3_moe.SPEC and config.num_experts == 4


# --- transformers 5's stacked experts ----------------------------------------------------------------------


def save_stacked(root, family: str):
    """(a tiny `family` model as transformers writes it by default, the same model saved with its experts
    stacked)."""
    from transformers import AutoModelForCausalLM

    per_expert = make_tiny_hf_model(root / "per_expert", family)
    AutoModelForCausalLM.from_pretrained(per_expert).save_pretrained(root / "stacked", save_original_format=False)
    return per_expert, root / "stacked"


@pytest.fixture(scope="module")
def stacked_pair(tmp_path_factory):
    return save_stacked(tmp_path_factory.mktemp("qwen3_moe_stacked"), "qwen3_moe")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_stacked_experts_convert_to_the_shards_of_per_expert_ones(family, tmp_path):
    """Qwen2-MoE's and DeepSeek-V3's routed experts stack the same way (their shared experts stay one tensor each)."""
    per_expert, stacked = save_stacked(tmp_path / "hf", family)
    assert any(name.endswith(".mlp.experts.gate_up_proj") for name in hf_tensors(stacked))
    for name, source in (("per_expert", per_expert), ("stacked", stacked)):
        convert_hf_to_mcore(source, tmp_path / name, tp=2, ep=2)
    for tp_rank in range(2):
        for ep_rank in range(2):
            coords = dict(tp_rank=tp_rank, pp_rank=0, pp=1, ep_rank=ep_rank, ep=2)
            want = megatron_legacy.read_shard(tmp_path / "per_expert", 0, **coords)
            got = megatron_legacy.read_shard(tmp_path / "stacked", 0, **coords)
            assert list(got) == list(want)
            assert all(torch.equal(got[name], want[name]) for name in want)


def test_stacked_experts_export_one_tensor_per_expert(stacked_pair, tmp_path):
    """The export uses the spelling every transformers version loads: bit for bit the per-expert checkpoint."""
    per_expert, stacked = stacked_pair
    convert_hf_to_mcore(stacked, tmp_path / "ckpt", pp=2)
    convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert_same_tensors(per_expert, tmp_path / "hf")


def test_dist_checkpoint_keys_of_a_model_mixing_dense_and_moe_layers_are_found():
    """megatron keys such a model layer by layer in a dist checkpoint, the experts stacked within each layer (the
    keys below are what megatron-core 0.16 writes for the tiny model: layer 1 dense). Every tensor the export
    reads must find its key and its index in it."""
    from verl_mega.checkpoint.torch_dist import _dist_key
    from verl_mega.models.sharding import rank_slots

    config = HFModelConfig.from_dict({"model_type": "qwen3_moe", **SIZES, "mlp_only_layers": [1]})
    attention = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
                 "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
                 "self_attention.linear_proj.weight")
    moe = ("mlp.linear_fc1.layer_norm_weight", "mlp.router.weight", "mlp.experts.experts.linear_fc1.weight",
           "mlp.experts.experts.linear_fc2.weight")
    dense = ("mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
    keys = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"}
    keys |= {f"decoder.layers.{layer}.{name}"
             for layer in range(4) for name in attention + (dense if layer == 1 else moe)}
    found = {slot.global_name: _dist_key(slot, keys) for slot in rank_slots(config, qwen3_moe.SPEC)}
    assert found["decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"] == (
        "decoder.layers.2.mlp.experts.experts.linear_fc2.weight", (1,))
    assert found["decoder.layers.0.pre_mlp_layernorm.weight"] == (
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight", ())
    assert found["decoder.layers.1.mlp.linear_fc1.weight"] == ("decoder.layers.1.mlp.linear_fc1.weight", ())
    assert {key for key, _ in found.values()} == keys


def copy_of(hf_dir, target):
    """A copy of a one-file HF folder (its config and weights), to corrupt."""
    target.mkdir()
    for name in ("config.json", "model.safetensors"):
        (target / name).write_bytes((hf_dir / name).read_bytes())
    return target


def test_stacked_experts_of_another_expert_count_are_refused(stacked_pair, tmp_path):
    _, stacked = stacked_pair
    hf_dir = copy_of(stacked, tmp_path / "hf")
    name = "model.layers.2.mlp.experts.down_proj"
    edit_tensors(hf_dir, lambda tensors: tensors.update({name: tensors[name][:3]}))
    with pytest.raises(ValueError) as err:
        convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")
    assert str(err.value) == (f"the checkpoint at {hf_dir}: tensor '{name}' has shape [3, 64, 32], not "
                              "[4 experts, rows, columns] as config.json implies")
    assert not (tmp_path / "ckpt").exists()


def test_experts_stored_in_both_spellings_are_refused(stacked_pair, tmp_path):
    per_expert, stacked = stacked_pair
    hf_dir = copy_of(stacked, tmp_path / "hf")
    extra = hf_tensors(per_expert)["model.layers.0.mlp.experts.1.up_proj.weight"]
    edit_tensors(hf_dir, lambda tensors: tensors.update({"model.layers.0.mlp.experts.1.up_proj.weight": extra}))
    with pytest.raises(ValueError, match="tensor 'model.layers.0.mlp.experts.1.up_proj.weight' is stored twice: on "
                                         "its own and inside 'model.layers.0.mlp.experts.gate_up_proj'"):
        convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")


@pytest.mark.parametrize("name, wrong, implied", [
    ("model.layers.0.mlp.experts.1.down_proj.weight", (64, 16), [64, 32]),  # moe_intermediate_size
    ("model.layers.1.mlp.up_proj.weight", (32, 64), [128, 64]),  # the dense layer: intermediate_size
    ("model.layers.0.self_attn.q_norm.weight", (16,), [32]),  # head_dim
])
def test_experts_dense_layers_and_norms_are_checked_against_config(tmp_path, name, wrong, implied):
    hf_dir = make_tiny_hf_model(tmp_path / "hf", "qwen3_moe")
    assert_wrong_shape_refused(hf_dir, tmp_path / "ckpt", name, wrong, implied)


@pytest.mark.parametrize("key, value, message", [
    ("decoder_sparse_step", 0, "model_type 'qwen3_moe' needs 'decoder_sparse_step' as a positive integer, got 0"),
    ("decoder_sparse_step", "2", "model_type 'qwen3_moe' needs 'decoder_sparse_step' as a positive integer, got '2'"),
    ("mlp_only_layers", "1", "'mlp_only_layers' must be a list of layer numbers, got '1'"),
    ("mlp_only_layers", [1.0], "'mlp_only_layers' must be a list of layer numbers, got [1.0]"),
])
def test_bad_sparsity_keys_are_config_errors(tmp_path, key, value, message):
    hf_dir = make_tiny_hf_model(tmp_path / "hf", "qwen3_moe", tokenizer=False)
    raw = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**raw, key: value}))
    with pytest.raises(ValueError) as err:
        convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")
    assert str(err.value) == f"{hf_dir / 'config.json'}: {message}"


def test_a_moe_size_left_out_reads_as_transformers_reads_it_and_a_null_one_is_a_config_error(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path / "hf", "qwen3_moe", tokenizer=False)
    raw = json.loads((hf_dir / "config.json").read_text())
    del raw["moe_intermediate_size"]  # transformers' Qwen3MoeConfig then has 768, which the tensors are not
    (hf_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"experts.0.gate_proj.weight' has shape \[32, 64\], config.json implies "
                                         r"\[768, 64\]"):
        convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")
    (hf_dir / "config.json").write_text(json.dumps({**raw, "moe_intermediate_size": None}))
    with pytest.raises(ValueError) as err:
        convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")
    assert str(err.value) == (f"{hf_dir / 'config.json'}: model_type 'qwen3_moe' needs 'moe_intermediate_size' as a "
                              "positive integer, got None")


def test_training_at_tp_above_1_without_sequence_parallelism_is_refused_naming_the_key(tiny_models, tmp_path):
    """Before any process starts, instead of megatron's error at the first training forward; TP 2 runs with
    sequence parallelism, on by default there."""
    from verl_mega.config import ConfigError, load_config
    from verl_mega.trainer.preflight import preflight_check

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"copy: {i}", "reward_model": {"ground_truth": str(i)}})
                                 for i in range(8)))
    overrides = [f"model.hf_path={tiny_models['qwen3_moe']}", f"data.train_files=[{prompts}]", "data.batch_size=4",
                 "actor.mini_batch_size=4", "critic.mini_batch_size=4"]
    preflight_check(load_config(None, overrides + ["parallel.ep=2"]), world_size=2)
    preflight_check(load_config(None, overrides + ["parallel.tp=2"]), world_size=2)
    with pytest.raises(ConfigError) as err:
        preflight_check(load_config(None, overrides + ["parallel.tp=2", "parallel.sequence_parallel=false"]),
                        world_size=2)
    assert ("parallel.tp=2: an MoE model (qwen3_moe) trains at TP > 1 only with sequence parallelism, which "
            "parallel.sequence_parallel=false or LoRA adapters turn off") in str(err.value)
