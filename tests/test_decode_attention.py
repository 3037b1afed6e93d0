"""The embedded engine's single-token attention on the CPU: the same numbers as SDPA within the float rounding
of the sums involved, every case it does not cover handed to transformers' SDPA path unchanged, and every
family decoding as before (tests/test_decoding.py compares greedy tokens with transformers for each)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verl_mega.models import HFModelConfig
from verl_mega.rollout.decode_attention import (
    IMPLEMENTATION, attention_forward, single_query_attention, use_decode_attention)

from .conftest import FAMILIES


def _inputs(rows, heads, kv_heads, cached, head_dim, dtype, padded_rows=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(shape, generator=generator, dtype=dtype) for shape in (
        (rows, heads, 1, head_dim), (rows, kv_heads, cached, head_dim), (rows, kv_heads, cached, head_dim)))
    keep = torch.ones(rows, 1, 1, cached, dtype=torch.bool)
    for row in range(min(padded_rows, rows)):  # left padding of different lengths
        keep[row, ..., :row + 1] = False
    return query, key, value, keep


class _Module(torch.nn.Module):
    """What transformers' attention functions read from the attention module."""

    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (12, 4), (8, 1)])
@pytest.mark.parametrize("masked", [True, False])
def test_equals_sdpa_within_the_rounding_of_its_sums(dtype, heads, kv_heads, masked):
    rows, cached, head_dim = 5, 37, 64
    query, key, value, keep = _inputs(rows, heads, kv_heads, cached, head_dim, dtype)
    keep = keep if masked else None
    scale = head_dim ** -0.5
    got = single_query_attention(query, key, value, keep, scale)
    groups = heads // kv_heads
    want = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                          attn_mask=keep, scale=scale).transpose(1, 2)
    assert got.shape == (rows, 1, heads, head_dim)
    # Each output is a convex combination of value rows: the scores' dot products (head_dim terms) and the
    # weighted sum (cached terms) each add at most their length in units of rounding, times the largest |value|.
    tolerance = (head_dim + cached) * torch.finfo(dtype).eps * value.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


def test_masked_positions_have_no_influence():
    query, key, value, keep = _inputs(4, 4, 2, 20, 16, torch.float32)
    changed_key, changed_value = key.clone(), value.clone()
    changed_key[~keep[:, 0, 0][:, None].expand(-1, 2, -1)] = 1e4
    changed_value[~keep[:, 0, 0][:, None].expand(-1, 2, -1)] = -1e4
    assert torch.equal(single_query_attention(query, key, value, keep, 0.25),
                       single_query_attention(query, changed_key, changed_value, keep, 0.25))


@pytest.mark.parametrize("case", ["prefill", "bf16", "float_mask", "dropout", "position_bias"])
def test_other_cases_go_to_transformers_sdpa_unchanged(case):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    query, key, value, keep = _inputs(3, 4, 2, 9, 16, dtype)
    kwargs = {}
    if case == "prefill":
        query = torch.randn(3, 4, 9, 16)
        keep = keep.expand(3, 1, 9, 9).tril()
    if case == "float_mask":
        keep = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    if case == "dropout":
        kwargs["dropout"] = 0.5
    if case == "position_bias":
        kwargs["position_bias"] = torch.randn(1, 4, 1, 9)
    module = _Module(groups=2)
    torch.manual_seed(0)
    got, _ = attention_forward(module, query, key, value, keep, scaling=0.25, **kwargs)
    torch.manual_seed(0)
    want, _ = sdpa_attention_forward(module, query, key, value, keep, scaling=0.25, **kwargs)
    assert torch.equal(got, want)


def test_soft_capping_fails_as_sdpa_does():
    query, key, value, keep = _inputs(2, 4, 2, 5, 8, torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        attention_forward(_Module(groups=2), query, key, value, keep, softcap=4.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_engines_attend_with_it_where_transformers_chose_sdpa(tiny_models, family):
    from transformers import AutoModelForCausalLM

    from verl_mega.rollout.embedded import EmbeddedEngine

    default = AutoModelForCausalLM.from_pretrained(tiny_models[family]).config._attn_implementation
    engine = EmbeddedEngine(HFModelConfig.read_raw(tiny_models[family]))
    assert engine.model.config._attn_implementation == (IMPLEMENTATION if default == "sdpa" else default)


def test_a_model_on_eager_attention_keeps_it(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], attn_implementation="eager")
    use_decode_attention(model)
    assert model.config._attn_implementation == "eager"


def test_decoded_logits_match_sdpa(tiny_models):
    """A whole model, prefill then 6 single-token steps over left-padded rows: the logits as SDPA's within the
    attention's rounding (the first test's bound per layer: head_dim + cached tokens units of eps), summed over
    the layers; measured 2.6e-7 of the largest logit against 1.3e-5 allowed."""
    from transformers import AutoModelForCausalLM, DynamicCache

    models = [AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"]).eval() for _ in range(2)]
    use_decode_attention(models[1])
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    steps = 7
    logits = []
    with torch.no_grad():
        for model in models:
            cache, ids, attention, outputs = DynamicCache(config=model.config), input_ids, mask, []
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            for _ in range(steps):
                outputs.append(model(input_ids=ids, attention_mask=attention, position_ids=positions,
                                     cache=cache, use_cache=True).logits[:, -1])
                ids = torch.tensor([[13], [14]])
                attention = torch.cat([attention, torch.ones(2, 1, dtype=attention.dtype)], -1)
                positions = positions[:, -1:] + 1
            logits.append(torch.stack(outputs))
    config = models[0].config
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = (head_dim + input_ids.shape[1] + steps) * torch.finfo(torch.float32).eps
    tolerance = per_layer * config.num_hidden_layers * logits[0].abs().max().item()
    assert models[1].config._attn_implementation == IMPLEMENTATION
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=tolerance)
