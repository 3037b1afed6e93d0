"""The embedded engine's decoding loop: sampling that follows the distribution and the filters transformers
applies, greedy output equal to transformers' `generate` for every family, one prefill per prompt, and
finished rows leaving the batch without changing the others."""
from __future__ import annotations

import pytest
import torch

from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.models import HFModelConfig
from verl_mega.rollout.decoding import draw, filtered_logits
from verl_mega.rollout.engine import SamplingParams

from .conftest import FAMILIES

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15], [16, 17, 18, 19]]


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8), (0.9, 40, 0.9), (1.0, 1, 0.5), (2.0, -1, 0.05)])
def test_filters_keep_what_transformers_keeps(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 3
    want = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    got = filtered_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_draws_follow_the_filtered_distribution():
    """200,000 draws from one row: every frequency within 5 standard errors of its probability (a false
    alarm about once in 1.7 million per entry), and nothing outside the top-k ever drawn."""
    draws = 200_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0, 1.5, -0.5])
    params = SamplingParams(top_k=6)
    probabilities = filtered_logits(logits[None], params).softmax(-1)[0]
    torch.manual_seed(0)
    counts = torch.bincount(draw(logits.expand(draws, -1), params), minlength=len(logits)).double()
    assert counts[probabilities == 0].sum() == 0
    standard_error = (probabilities * (1 - probabilities) / draws).sqrt()
    assert ((counts / draws - probabilities).abs() <= 5 * standard_error + 1e-12).all(), counts / draws


def _engine(hf_dir):
    from verl_mega.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(HFModelConfig.read_raw(hf_dir))
    reader = SafetensorsReader(hf_dir)
    engine.load_weights((name, reader.read(name)) for name in reader.names())
    return engine


def _batch_sizes(engine):
    sizes = []
    engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    return sizes


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_with_left_padded_prompts(tiny_models, family):
    from transformers import AutoModelForCausalLM

    engine = _engine(tiny_models[family])
    reference = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32).eval()
    responses = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8, n=2))
    assert [r.prompt_index for r in responses] == [0, 0, 1, 1, 2, 2, 3, 3]
    for response in responses:
        prompt = PROMPTS[response.prompt_index]
        want = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8)[0, len(prompt):]
        assert response.token_ids == want.tolist(), family


def test_each_prompt_is_prefilled_once_for_its_samples(tiny_models):
    engine = _engine(tiny_models["qwen2"])
    sizes = _batch_sizes(engine)
    responses = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, n=3, seed=0))
    assert len(responses) == 12 and sizes == [4, 12, 12, 12]


def test_finished_rows_leave_the_batch_and_the_rest_decode_unchanged(tiny_models):
    engine = _engine(tiny_models["qwen2"])
    alone = [engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10))[0].token_ids
             for prompt in PROMPTS]
    stop = alone[1][1]  # the second prompt stops after two tokens
    expected = [tokens[: tokens.index(stop) + 1] if stop in tokens else tokens for tokens in alone]
    sizes = _batch_sizes(engine)
    responses = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10,
                                                        stop_token_ids=(stop,), logprobs=True))
    assert [r.token_ids for r in responses] == expected
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    assert min(sizes) < len(PROMPTS), "a quarter of the rows finished: they must leave the batch"
    assert len(sizes) == max(len(tokens) for tokens in expected)


def test_reserved_cache_layer_holds_what_concatenation_would_without_copying_it_per_token():
    from transformers.cache_utils import DynamicLayer

    from verl_mega.rollout.decoding import ReservedLayer

    generator = torch.Generator().manual_seed(0)

    def states(rows, tokens):
        return [torch.randn(rows, 2, tokens, 8, generator=generator) for _ in range(2)]

    reserved, dynamic = ReservedLayer(capacity=12), DynamicLayer()
    steps = [("update", states(3, 5))] + [("update", states(3, 1))] * 2 + [("repeat", 2)] + \
            [("update", states(6, 1))] * 2 + [("select", torch.tensor([0, 2, 5]))] + [("update", states(3, 1))] * 3
    room_moves = 0
    for action, argument in steps:
        room = reserved.key_room
        for layer in (reserved, dynamic):
            if action == "update":
                layer.update(*argument)
            elif action == "repeat":
                layer.batch_repeat_interleave(argument)
            else:
                layer.batch_select_indices(argument)
        assert torch.equal(reserved.keys, dynamic.keys) and torch.equal(reserved.values, dynamic.values)
        assert reserved.get_seq_length() == dynamic.get_seq_length()
        room_moves += action == "update" and reserved.key_room is not room
    # Room is taken at the prefill and after each change of rows, never for a decoded token.
    assert room_moves == 3 and reserved.key_room.shape[-2] == 12
