"""Every key of every family's config.json, and the keys the readers look for beyond them, set in turn to null, a
huge or negative number, the wrong type: reading, mapping and sizing the model either works or raises the
ValueError the command line prints as one line. 201 of these cases ended in a traceback (a TypeError, a
MemoryError for 99999999999 layers) before the readers checked them."""
import json

import pytest

from verl_mega.models.builder import architecture
from verl_mega.models.expected_shapes import expected_hf_shapes
from verl_mega.models.families import load_hf_model_config, sequence_limit
from verl_mega.models.hf_config import rope_inv_freq

from ..conftest import FAMILIES

LOOKED_FOR = ("hidden_act", "hidden_activation", "sliding_window", "use_sliding_window", "layer_types",
              "attention_bias", "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "quantization_config",
              "rope_scaling", "rope_theta", "partial_rotary_factor", "head_dim", "num_key_value_heads",
              "tie_word_embeddings", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
              "q_lora_rank", "n_group", "topk_group", "first_k_dense_replace", "num_nextn_predict_layers",
              "routed_scaling_factor", "moe_intermediate_size", "shared_expert_intermediate_size", "max_window_layers",
              "text_config", "architectures", "bos_token_id", "eos_token_id", "pad_token_id")
HOSTILE = (None, -1, 0, 2 ** 40, 99999999999, "x", "", 1.5, True, [], {}, [1, "a"], {"a": 1}, float("nan"),
           float("inf"), -0.5)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_key_read_refuses_what_it_cannot_take_with_a_value_error(tiny_models, tmp_path, model_type):
    base = json.loads((tiny_models[model_type] / "config.json").read_text())
    tracebacks = []
    for key in sorted(set(base) | set(LOOKED_FOR)):
        for value in HOSTILE:
            (tmp_path / "config.json").write_text(json.dumps({**base, key: value}))
            try:
                config, family = load_hf_model_config(tmp_path)
                architecture(config, family), expected_hf_shapes(config, family), sequence_limit(config, family)
                rope_inv_freq(config)
            except ValueError:
                pass
            except Exception as err:  # noqa: BLE001 - what is collected here is the failure
                tracebacks.append(f"{key}={value!r}: {type(err).__name__}: {str(err)[:100]}")
    assert not tracebacks, f"{len(tracebacks)} tracebacks, e.g. " + "; ".join(tracebacks[:5])
