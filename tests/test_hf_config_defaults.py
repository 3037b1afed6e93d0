"""Keys a config.json leaves out read as transformers reads them: its config class's defaults, never ours. 4.x's
`save_pretrained` left out values equal to its base class's, so Gemma-2 checkpoints carry no `tie_word_embeddings`
(and tie): read as untied, their conversion was refused for a missing `lm_head.weight`."""
import copy
import functools
import json

import pytest

from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.converters.verify import verify_checkpoint
from verl_mega.models import HFModelConfig
from verl_mega.models.builder import architecture
from verl_mega.models.families import family_for, sequence_limit
from verl_mega.models.hf_config import transformers_defaults
from verl_mega.models.tiny import make_tiny_hf_model

from .conftest import FAMILIES


def _comparable(value):
    if isinstance(value, functools.partial):  # Gemma-2's tanh GELU: a new partial at each call
        return value.func, value.keywords
    return value


def _reading(raw: dict) -> tuple:
    """Everything the converters and the model builder take from a config.json."""
    config = HFModelConfig.from_dict(raw)
    family = family_for(config)
    shape = {key: _comparable(value) for key, value in architecture(config, family).items()}
    return config, shape, sequence_limit(config, family), family.moe_layer_pattern(config)


def _left_out_keys():
    for model_type in FAMILIES:
        defaults, _, _ = transformers_defaults(model_type)
        for key in sorted(defaults):
            yield model_type, key
        yield model_type, "rope_parameters"  # RoPE's theta, from its own default


@pytest.mark.parametrize("model_type, key", list(_left_out_keys()), ids=lambda v: str(v))
def test_a_key_left_out_reads_as_transformers_reads_it(tiny_models, model_type, key):
    from transformers import AutoConfig

    raw = json.loads((tiny_models[model_type] / "config.json").read_text())
    if key not in raw:
        pytest.skip(f"the tiny {model_type} config.json has no {key}")
    left_out = {k: v for k, v in raw.items() if k != key}
    if key == "rope_parameters" and "rope_type" in (scaling := raw[key]) and scaling["rope_type"] != "default":
        left_out["rope_scaling"] = {k: v for k, v in scaling.items() if k != "rope_theta"}  # theta alone left out
    theirs = AutoConfig.for_model(**copy.deepcopy(left_out)).to_dict()  # it edits RoPE's dict in place
    try:
        ours = _reading(left_out)
    except ValueError as err:  # refused: transformers' reading of it is refused the same way
        with pytest.raises(ValueError, match="config.json"):
            _reading(theirs)
        assert str(err)
        return
    assert ours == _reading(theirs)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_config_transformers_5_wrote_gets_nothing_added(tiny_models, model_type):
    # Not even a key under another of its names (Qwen3-MoE writes num_local_experts, declares num_experts), which
    # an export would write beside it for transformers to read over the model's own.
    raw = json.loads((tiny_models[model_type] / "config.json").read_text())
    assert HFModelConfig.from_dict(raw).raw == raw


def test_defaults_come_from_transformers_and_a_plugins_type_has_none():
    gemma2, _, _ = transformers_defaults("gemma2")
    assert gemma2["tie_word_embeddings"] is True and gemma2["head_dim"] == 256
    assert transformers_defaults("mixtral")[1] == 1e6  # Mixtral's RoPE theta, where ours would have been 1e4
    assert transformers_defaults("internlm2") == ({}, None, {})
    for model_type in FAMILIES:  # sizes a config must give are never defaulted
        assert not {"hidden_size", "num_hidden_layers", "vocab_size"} & set(transformers_defaults(model_type)[0])


@pytest.fixture(scope="module")
def gemma2_as_shipped(tmp_path_factory):
    """A Gemma-2 whose config.json, like Google's, leaves out tie_word_embeddings."""
    hf_dir = make_tiny_hf_model(tmp_path_factory.mktemp("gemma2_shipped") / "hf", "gemma2")
    raw = json.loads((hf_dir / "config.json").read_text())
    assert raw.pop("tie_word_embeddings") is True
    (hf_dir / "config.json").write_text(json.dumps(raw))
    return hf_dir


def test_a_gemma2_config_without_the_tie_key_converts_tied(gemma2_as_shipped, tmp_path):
    convert_hf_to_mcore(gemma2_as_shipped, tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "verl_mega_manifest.json").read_text())
    assert manifest["hf_config"]["tie_word_embeddings"] is True


@pytest.mark.slow
def test_a_gemma2_config_without_the_tie_key_has_parity(gemma2_as_shipped, tmp_path):
    convert_hf_to_mcore(gemma2_as_shipped, tmp_path / "ckpt", tp=2)
    parity = verify_checkpoint(gemma2_as_shipped, tmp_path / "ckpt", seq_len=16)
    assert parity.passed, parity.describe()
