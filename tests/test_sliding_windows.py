"""Sliding windows the megatron model here does not run (every family but Gemma-2): read from config.json as
transformers reads it, and sequences held within them by the pre-flight check and `convert verify`. Past the
window the two score different models: parity at 16 tokens over a window of 4 was 1.7-5.4x the logits' RMS off."""
import json

import pytest

from verl_mega.cli import main as cli
from verl_mega.config import ConfigError, load_config
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.converters.verify import verify_checkpoint
from verl_mega.models import HFModelConfig
from verl_mega.models.families import FAMILIES, family_for, sequence_limit
from verl_mega.models.tiny import TINY_SIZES, make_tiny_hf_model
from verl_mega.trainer.preflight import preflight_check

from .test_config import good_overrides, prompt_file  # noqa: F401

# transformers' modeling: these families mask by `layer_types`, the others slide every layer by `sliding_window`.
PER_LAYER_TYPES = ("qwen2", "qwen3", "qwen2_moe")
VARIANTS = [dict(), dict(sliding_window=None), dict(sliding_window=8), dict(use_sliding_window=True, sliding_window=8),
            dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
            dict(use_sliding_window=True, sliding_window=8, max_window_layers=99),
            dict(use_sliding_window=False, sliding_window=8)]


def _window_transformers_applies(config) -> int | None:
    if config.model_type in PER_LAYER_TYPES and "sliding_attention" not in config.layer_types:
        return None
    return config.sliding_window or None  # Qwen2-MoE writes 0 for none


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.unmodelled_window is not None], ids=lambda f: f.name)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: json.dumps(v))
@pytest.mark.parametrize("writer", ["5.x", "4.x", "key-absent"])
def test_the_window_is_the_one_transformers_reads(family, variant, writer):
    from transformers import AutoConfig

    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_local_experts=4)
    extra = experts if family.moe else {}
    raw = AutoConfig.for_model(family.model_types[0], **TINY_SIZES, **extra, **variant).to_dict()
    if writer == "4.x":  # transformers 4 wrote no layer_types
        raw.pop("layer_types", None)
    if writer == "key-absent":
        raw.pop("sliding_window", None)
    ours = family.unmodelled_window(HFModelConfig.from_dict(raw))
    theirs = _window_transformers_applies(AutoConfig.for_model(**raw))
    if writer == "4.x" and family.name in PER_LAYER_TYPES and theirs is None and ours is not None:
        # Without layer_types, which layers slide is left unread: a window on some layer is assumed.
        assert raw.get("use_sliding_window") is True
        return
    assert ours == theirs, (raw.get("sliding_window"), raw.get("layer_types"))


def test_gemma2_runs_its_window_and_llama_has_none(tiny_models):
    for name in ("gemma2", "llama", "deepseek_v3"):  # Gemma-2's window of 5 is run, not a limit
        config = HFModelConfig.from_dict(json.loads((tiny_models[name] / "config.json").read_text()))
        limit, why = sequence_limit(config, family_for(config))
        assert limit == 256 and why.startswith("context of 256 (max_position_embeddings"), why


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory):
    """A Mistral whose every layer slides over 8 keys (Mistral 7B v0.1's 4096, scaled down)."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("mistral_w8") / "hf", "mistral", sliding_window=8)


def test_preflight_holds_prompt_and_response_in_the_window(tiny_models, prompt_file, windowed_mistral):  # noqa: F811
    overrides = good_overrides(tiny_models, prompt_file) + [f"model.hf_path={windowed_mistral}"]
    with pytest.raises(ConfigError) as err:
        preflight_check(load_config(None, overrides), world_size=4)
    assert "exceed model.hf_path's sliding window of 8 (sliding_window in its config.json" in str(err.value)
    preflight_check(load_config(None, overrides + ["data.max_prompt_length=4", "data.max_response_length=4"]),
                    world_size=4)


def test_verify_refuses_a_seq_len_past_the_window(windowed_mistral, tmp_path, capsys):
    convert_hf_to_mcore(windowed_mistral, tmp_path / "ckpt")  # the weights convert; only longer sequences differ
    assert cli(["convert", "verify", "--hf", str(windowed_mistral), "--ckpt", str(tmp_path / "ckpt"),
                "--seq-len", "9"]) == 2
    assert "--seq-len 9 exceeds the model's sliding window of 8" in capsys.readouterr().err


@pytest.mark.slow
def test_parity_holds_up_to_the_window(windowed_mistral, tmp_path):
    convert_hf_to_mcore(windowed_mistral, tmp_path / "ckpt")
    parity = verify_checkpoint(windowed_mistral, tmp_path / "ckpt", seq_len=8)
    assert parity.passed, parity.describe()
