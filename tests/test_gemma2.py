"""Gemma-2 as a megatron-core spec: layer kinds and config refusals here; round trips and logit parity at
(1,1), (2,1), (1,2), (2,2) on sequences of 16 past a window of 5 run with the other families in
test_convert.py; the HybridEngine transition and the embedded engine's greedy generation below."""
import os
from pathlib import Path

import pytest
import torch

from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf
from verl_mega.models import HFModelConfig
from verl_mega.models.families import family_for, gemma2
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.parallel.spawn import run_torchrun

from .faults.convert_tools import assert_wrong_shape_refused
from .test_layout_invariance import ACTOR_METRICS, LOGPROB_ATOL, REL_TOL, rel_diff

# Means of old-minus-new log-prob differences (~3e-3 here): their error is that of the log-probs (~6 in
# size, fp32 rounding ~1e-7 each summed in another order per layout), not a fraction of their own small size.
LOGPROB_DIFFERENCES = ("ppo_kl", "kl_loss")
LOGPROB_DIFFERENCE_ATOL = 1e-6

BASE = dict(model_type="gemma2", hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=4,
            vocab_size=32, intermediate_size=32, head_dim=8, sliding_window=3)


def test_sliding_layers_follow_transformers_layer_types():
    from transformers import AutoConfig

    config = AutoConfig.for_model(**BASE)
    raw = config.to_dict()
    assert gemma2.sliding_layers(HFModelConfig.from_dict(raw)) == [t == "sliding_attention" for t in config.layer_types]
    raw.pop("layer_types")  # configs written before transformers had the key
    assert gemma2.sliding_layers(HFModelConfig.from_dict(raw)) == [True, False, True, False]
    overrides = gemma2.transformer_overrides(HFModelConfig.from_dict(raw))
    assert overrides["window_size"] == (2, 0) and overrides["window_attn_skip_freq"] == [1, 0, 1, 0]


def test_unsupported_activation_bidirectional_attention_and_a_broken_window_are_refused():
    for extra, message in (({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported for gemma2"),
                           ({"use_bidirectional_attention": True}, "'use_bidirectional_attention' must be false"),
                           ({"sliding_window": "5"}, "needs 'sliding_window' as a positive integer"),
                           ({"query_pre_attn_scalar": 0}, "'query_pre_attn_scalar' must be a positive number, got 0"),
                           ({"final_logit_softcapping": "30"}, "'final_logit_softcapping' must be a positive number "
                                                               "or null"),
                           ({"layer_types": "sliding"}, "'layer_types' must list an attention kind")):
        with pytest.raises(ValueError, match=message):
            family_for(HFModelConfig.from_dict({**BASE, **extra}))
    assert family_for(HFModelConfig.from_dict({**BASE, "hidden_act": "gelu_pytorch_tanh"})) is gemma2.SPEC


@pytest.mark.parametrize("name, wrong, implied", [
    ("model.layers.1.post_feedforward_layernorm.weight", (32,), [64]),  # sandwich norms: hidden_size
    ("model.layers.0.post_attention_layernorm.weight", (24,), [64]),
    ("model.layers.0.self_attn.o_proj.weight", (64, 64), [64, 96]),  # head_dim 24 x 4 heads, not hidden
])
def test_norms_and_head_dim_are_checked_against_config(tmp_path, name, wrong, implied):
    assert_wrong_shape_refused(make_tiny_hf_model(tmp_path / "hf", "gemma2"), tmp_path / "ckpt", name, wrong, implied)


@pytest.mark.slow
def test_hybrid_engine_transition_and_greedy_rollout_equal_transformers(tiny_models, tmp_path):
    hf_dir = tiny_models["gemma2"]
    convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", tp=2, pp=2)
    exported = convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "export")
    run_torchrun(4, "tests.workers.hybrid_worker", ["--tp", "2", "--pp", "2", "--case", f"gemma2,{hf_dir},{tmp_path / 'ckpt'},1",
                                            "--greedy", f"gemma2={exported}"])


@pytest.mark.slow
def test_ppo_update_is_layout_invariant_and_log_probs_match_hf(tmp_path):
    """roles_worker (see test_layout_invariance.py) on a 2-layer Gemma-2 with a window of 3 over 11 left-padded
    tokens: (1,1), (2,1), (1,2) in one 2-process launch."""
    hf_dir = make_tiny_hf_model(tmp_path / "hf", "gemma2", num_hidden_layers=2, sliding_window=3)
    layouts = [(2, 1), (1, 2), (1, 1)]
    for tp, pp in layouts:
        convert_hf_to_mcore(hf_dir, tmp_path / "ckpt" / f"tp{tp}pp{pp}", tp=tp, pp=pp)
    (tmp_path / "out").mkdir()
    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": ":".join(filter(None, [tests_dir, str(Path(tests_dir).parent),
                                                      *os.environ.get("PYTHONPATH", "").split(":")]))}
    run_torchrun(2, "tests.workers.roles_worker", [str(tmp_path / "ckpt"), str(hf_dir), str(tmp_path / "out"), "fp32",
                                     *(f"{tp},{pp}" for tp, pp in layouts)], env=env)

    def result(tp, pp):
        stages = [torch.load(tmp_path / "out" / f"tp{tp}pp{pp}dp{2 // (tp * pp)}_stage{stage}.pt") for stage in range(pp)]
        stages[-1]["weights"] = {name: t for stage in stages for name, t in stage["weights"].items()}
        return stages[-1]

    reference = result(1, 1)
    for tp, pp in layouts:
        got = result(tp, pp)
        mask = got["response_mask"].bool()
        torch.testing.assert_close(got["log_probs"][mask], got["hf_log_probs"][mask], rtol=0, atol=LOGPROB_ATOL)
        for name in ACTOR_METRICS + tuple(name for name in LOGPROB_DIFFERENCES if name not in ACTOR_METRICS):
            got_value, want = got["actor_metrics"][name], reference["actor_metrics"][name]
            if name in LOGPROB_DIFFERENCES:
                assert abs(got_value - want) <= LOGPROB_DIFFERENCE_ATOL, (tp, pp, name, got_value, want)
            else:
                assert rel_diff(got_value, want) <= REL_TOL, (tp, pp, name)
        assert max(rel_diff(got["weights"][n], reference["weights"][n]) for n in reference["weights"]) <= REL_TOL
