"""Qwen2-MoE: shared expert with its sigmoid gate, norm_topk_prob, dense layers; parity at TP and EP.

Round trips and parity at (1,1), (2,1), (1,2), (2,2) run with the other families in test_convert.py.
"""
import pytest

from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf
from verl_mega.converters.verify import verify_checkpoints
from verl_mega.models import HFModelConfig
from verl_mega.models.families import load_hf_model_config, qwen2_moe
from verl_mega.models.tiny import make_tiny_hf_model

from .faults.convert_tools import assert_wrong_shape_refused, edit_json
from .test_convert import assert_same_tensors
from .test_deepseek_v3 import VARIANTS as DEEPSEEK_VARIANTS

# The other way round from the tiny model's defaults: renormalised top-k, every second layer MoE.
VARIANT = dict(norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[])
# Qwen3-MoE the other way round likewise: top-k weights not renormalised, every second layer MoE.
QWEN3_MOE_VARIANT = dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])


@pytest.mark.parametrize("sparsity, expected", [
    (dict(mlp_only_layers=[1]), [True, False, True, True]),
    (dict(decoder_sparse_step=2, mlp_only_layers=[]), [False, True, False, True]),
    (dict(decoder_sparse_step=2, mlp_only_layers=[3]), [False, True, False, False]),
])
def test_moe_layers_are_the_ones_transformers_builds(sparsity, expected):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2_moe", hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                  shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
                                  num_key_value_heads=1, num_experts=2, num_experts_per_tok=1, vocab_size=32, **sparsity)
    model = AutoModelForCausalLM.from_config(config)
    built = [hasattr(layer.mlp, "shared_expert") for layer in model.model.layers]
    assert built == expected == qwen2_moe.moe_layers(HFModelConfig.from_dict(config.to_dict()))


def test_norm_topk_prob_selects_megatron_routing():
    base = dict(model_type="qwen2_moe", hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                num_hidden_layers=2, vocab_size=32, intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=16, num_experts=2)
    for norm_topk_prob in (False, True):
        overrides = qwen2_moe.transformer_overrides(HFModelConfig.from_dict({**base, "norm_topk_prob": norm_topk_prob}))
        assert overrides["moe_router_pre_softmax"] is not norm_topk_prob
        assert overrides["moe_shared_expert_gate"] is True


@pytest.mark.parametrize("family, extra", [("qwen2_moe", dict(norm_topk_prob=True)), ("qwen3_moe", {}),
                                           ("mixtral", {})])
def test_renormalised_top_1_is_refused_and_plain_top_1_runs(tmp_path, family, extra):
    # Renormalised, transformers weighs the one expert by 1; megatron runs top-1 only from the softmax over all.
    hf_dir = make_tiny_hf_model(tmp_path / "hf", family, num_experts_per_tok=1, **extra)
    with pytest.raises(ValueError, match="num_experts_per_tok=1 with renormalised top-k weights is not supported"):
        load_hf_model_config(hf_dir)
    edit_json(hf_dir / "config.json", lambda config: config.update(norm_topk_prob=False))
    if family != "mixtral":  # Mixtral always renormalises
        load_hf_model_config(hf_dir)  # megatron's pre-softmax top-1: parity below


@pytest.mark.slow
def test_top_1_routing_without_renormalising_has_parity(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path / "hf", "qwen2_moe", num_experts_per_tok=1, norm_topk_prob=False)
    convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", pp=2)
    [parity] = verify_checkpoints([(hf_dir, tmp_path / "ckpt")])
    assert parity.passed, parity.describe()


@pytest.mark.slow
def test_logit_parity_at_expert_parallel_and_round_trip(tiny_models, tmp_path):
    sources = {"qwen2_moe": tiny_models["qwen2_moe"], "mixtral": tiny_models["mixtral"],
               "qwen2_moe-variant": make_tiny_hf_model(tmp_path / "variant", "qwen2_moe", seed=1, **VARIANT),
               "qwen3_moe": tiny_models["qwen3_moe"],
               "qwen3_moe-variant": make_tiny_hf_model(tmp_path / "qwen3_variant", "qwen3_moe", seed=1,
                                                       **QWEN3_MOE_VARIANT),
               "deepseek_v3": tiny_models["deepseek_v3"]}
    for name, extra in DEEPSEEK_VARIANTS.items():  # sharing this launch: a torchrun start costs more than a model
        sources[f"deepseek_v3-{name}"] = make_tiny_hf_model(tmp_path / name, "deepseek_v3", seed=1, **extra)
    pairs = []
    for name, hf_dir in sources.items():
        convert_hf_to_mcore(hf_dir, tmp_path / name, tp=2, ep=2)
        convert_mcore_to_hf(tmp_path / name, tmp_path / f"{name}-hf")
        assert_same_tensors(hf_dir, tmp_path / f"{name}-hf")
        pairs.append((hf_dir, tmp_path / name))
    for (name, _), parity in zip(sources.items(), verify_checkpoints(pairs)):
        assert parity.passed and parity.max_abs <= 1e-4, f"{name} at tp=2 ep=2: {parity.describe()}"


# --- tensors checked against config.json (expected_shapes, from the spec's rules) ---------------------------


@pytest.mark.parametrize("name, wrong, implied", [
    ("model.layers.0.mlp.shared_expert.up_proj.weight", (32, 64), [64, 64]),  # shared_expert_intermediate_size
    ("model.layers.0.mlp.shared_expert_gate.weight", (2, 64), [1, 64]),
    ("model.layers.0.mlp.experts.1.down_proj.weight", (64, 16), [64, 32]),  # moe_intermediate_size
])
def test_shared_expert_and_experts_are_checked_against_config(tmp_path, name, wrong, implied):
    assert_wrong_shape_refused(make_tiny_hf_model(tmp_path / "hf", "qwen2_moe"), tmp_path / "ckpt", name, wrong, implied)


def test_a_null_moe_size_is_a_config_error(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path / "hf", "qwen2_moe")  # (left out, it reads as transformers' 5632)
    edit_json(hf_dir / "config.json", lambda config: config.update(shared_expert_intermediate_size=None))
    with pytest.raises(ValueError) as err:
        convert_hf_to_mcore(hf_dir, tmp_path / "ckpt")
    assert str(err.value) == (f"{hf_dir / 'config.json'}: model_type 'qwen2_moe' needs "
                              "'shared_expert_intermediate_size' as a positive integer, got None")
