"""Gemma-2 as a megatron-core spec: layer kinds and config refusals here; round trips and logit parity at
(1,1), (2,1), (1,2), (2,2) on sequences of 16 past a window of 5 run with the other families in
test_convert.py; the HybridEngine transition and the embedded engine's greedy generation below."""
import pytest

from verl_mega.models import HFModelConfig
from verl_mega.models.families import gemma2
from verl_mega.parallel.launch import run_torchrun

BASE = dict(model_type="gemma2", hidden_size=16, num_attention_heads=2, num_hidden_layers=4, vocab_size=32,
            intermediate_size=32, head_dim=8, sliding_window=3)


def test_sliding_layers_follow_transformers_layer_types():
    from transformers import AutoConfig

    config = AutoConfig.for_model(**BASE)
    raw = config.to_dict()
    assert gemma2.sliding_layers(HFModelConfig.from_dict(raw)) == [t == "sliding_attention" for t in config.layer_types]
    raw.pop("layer_types")  # configs written before transformers had the key
    assert gemma2.sliding_layers(HFModelConfig.from_dict(raw)) == [True, False, True, False]
    overrides = gemma2.transformer_overrides(HFModelConfig.from_dict(raw))
    assert overrides["window_size"] == (2, 0) and overrides["window_attn_skip_freq"] == [1, 0, 1, 0]


def test_unsupported_activation_is_refused():
    cfg = HFModelConfig.from_dict({**BASE, "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="hidden_activation 'relu' is not supported"):
        gemma2.transformer_overrides(cfg)


@pytest.mark.slow
def test_hybrid_engine_transition_and_greedy_rollout_equal_transformers(tiny_models, tmp_path):
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf

    hf_dir = tiny_models["gemma2"]
    convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", tp=2, pp=2)
    exported = convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "export")
    run_torchrun(4, "tests.hybrid_worker", ["--tp", "2", "--pp", "2", "--case", f"gemma2,{hf_dir},{tmp_path / 'ckpt'},1",
                                            "--greedy", f"gemma2={exported}"])
