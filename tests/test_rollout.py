"""Rollout engines in one process: the embedded engine's in-place loading and sampling parameters, the
vLLM engine's refusal without vLLM (tests/test_vllm_rollout.py runs it), and the training-memory context on CPU."""
from __future__ import annotations

import gc
import importlib.util
import weakref

import pytest
import torch

from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.models import HFModelConfig
from verl_mega.rollout.engine import SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10]]


def _stream(hf_dir, shift: float = 0.0):
    reader = SafetensorsReader(hf_dir)
    return ((name, reader.read(name) + shift) for name in reader.names())


@pytest.fixture(scope="module", params=["qwen2", "mixtral"])
def loaded(request, tiny_models):
    from verl_mega.rollout.embedded import EmbeddedEngine

    hf_dir = tiny_models[request.param]
    engine = EmbeddedEngine(HFModelConfig.read_raw(hf_dir))
    engine.load_weights(_stream(hf_dir))
    return hf_dir, engine


def test_embedded_greedy_equals_transformers(loaded):
    from transformers import AutoModelForCausalLM

    hf_dir, engine = loaded
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    responses = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))
    for prompt, response in zip(PROMPTS, responses):
        want = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6)[0, len(prompt):]
        assert response.token_ids == want.tolist()


def forward_logprobs(model, prompt: list[int], tokens: list[int], temperature: float, top_k: int = -1
                     ) -> list[float]:
    """Log-probs of `tokens` after `prompt` from one full forward: softmax(logits / temperature), renormalised
    over the top-k logits where top_k is set."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float() / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("temperature, top_k", [(0.0, -1), (1.0, -1), (0.7, -1), (1.3, 5)])
def test_embedded_logprobs_equal_a_forward_of_the_same_weights(loaded, temperature, top_k):
    """Each sampled token's log-prob from the decode loop (KV cache, one row per sample) is its log-prob under
    the distribution it was drawn from, as one forward over prompt + response computes it (fp32 rounding):
    logits / temperature (greedy: temperature 1), renormalised over the top-k where that is on."""
    from transformers import AutoModelForCausalLM

    hf_dir, engine = loaded
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=6, n=2, seed=3, logprobs=True)
    for response in engine.generate(PROMPTS, params):
        want = forward_logprobs(model, PROMPTS[response.prompt_index], response.token_ids, temperature or 1.0,
                                top_k)
        torch.testing.assert_close(torch.tensor(response.logprobs), torch.tensor(want), atol=1e-5, rtol=1e-5)


def test_embedded_loads_in_place_without_a_new_model(loaded):
    hf_dir, engine = loaded
    model, first = engine.model, next(engine.model.parameters())
    before = first.detach().clone()
    engine.load_weights(_stream(hf_dir, shift=1.0))
    assert engine.model is model and next(engine.model.parameters()) is first
    assert torch.equal(first.detach(), before + 1.0)
    engine.load_weights(_stream(hf_dir))
    assert torch.equal(first.detach(), before)


def test_sampling_parameters(loaded):
    _, engine = loaded
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, max_new_tokens=5, n=3, seed=7, logprobs=True)
    first, again = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert [r.prompt_index for r in first] == [0, 0, 0, 1, 1, 1]
    assert [r.token_ids for r in first] == [r.token_ids for r in again], "same seed, same samples"
    for response in first:
        assert len(response.logprobs) == len(response.token_ids) <= 5
        assert all(lp <= 0 for lp in response.logprobs)
    greedy = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=6))[0].token_ids
    stop = greedy[2]
    stopped = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=(stop,)))
    assert stopped[0].token_ids == greedy[: greedy.index(stop) + 1]


def test_sampling_without_top_k_draws_from_the_whole_vocabulary(loaded):
    """top_k=-1 must not fall back to transformers' default top 50: the old log-probs are the full softmax's.
    At temperature 100 the tiny model is near uniform over 300 tokens: 256 draws give ~170 distinct ones."""
    _, engine = loaded
    params = SamplingParams(temperature=100.0, max_new_tokens=1, n=256, seed=0)
    assert len({response.token_ids[0] for response in engine.generate(PROMPTS[:1], params)}) > 50


def test_embedded_refuses_sliced_or_foreign_tensors(loaded):
    hf_dir, engine = loaded
    with pytest.raises(ValueError, match="needs full tensors"):
        engine.load_weights([("model.embed_tokens.weight", torch.zeros(3, 3))])
    with pytest.raises(KeyError, match="no parameter 'model.unknown.weight'"):
        engine.load_weights([("model.unknown.weight", torch.zeros(1))])


def _round_trip(model):
    model.to(torch.float64).to(torch.float32)


def _reallocate(model):
    for param in model.parameters():
        param.data = torch.empty_like(param)


@pytest.mark.parametrize("family", ["qwen2", "mixtral"])
@pytest.mark.parametrize("move", [_round_trip, _reallocate], ids=["to_round_trip", "new_storage"])
def test_loads_reach_the_live_parameters_after_their_storage_moves(tiny_models, family, move):
    """On a GPU `sleep` / `wake_up` move the model with `.to()`, giving every parameter new storage (the CPU's
    sleep is a no-op, so the move is made here between them: a round trip, or fresh uninitialized storage as a
    wake-up's allocation gives). The next load must land in what generation computes with, and the engine must
    not keep the old storage alive (the weights held twice)."""
    from verl_mega.rollout.embedded import EmbeddedEngine

    hf_dir, greedy = tiny_models[family], SamplingParams(temperature=0, max_new_tokens=6, logprobs=True)
    engine = EmbeddedEngine(HFModelConfig.read_raw(hf_dir))
    engine.load_weights(_stream(hf_dir))
    before = engine.generate(PROMPTS, greedy)
    old_storage = [weakref.ref(param.untyped_storage()) for param in engine.model.parameters()]
    engine.sleep()
    move(engine.model)
    engine.wake_up()
    gc.collect()
    assert all(ref() is None for ref in old_storage), "the engine keeps the weights' old storage alive"
    engine.load_weights(_stream(hf_dir, shift=0.05))
    fresh = EmbeddedEngine(HFModelConfig.read_raw(hf_dir))
    fresh.load_weights(_stream(hf_dir, shift=0.05))
    want = fresh.generate(PROMPTS, greedy)
    assert [r.logprobs for r in before] != [r.logprobs for r in want], "the new weights must change generation"
    got = engine.generate(PROMPTS, greedy)
    assert [(r.token_ids, r.logprobs) for r in got] == [(r.token_ids, r.logprobs) for r in want]


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=0), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(n=0), "n ")])
def test_sampling_params_refuse_nonsense(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


VLLM_IMPORTABLE = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(VLLM_IMPORTABLE, reason="vLLM is installed: the refusal path does not apply")
def test_vllm_engine_refused_without_vllm(tiny_models):
    from verl_mega.rollout.engine import WeightFeed
    from verl_mega.rollout.vllm_engine import VLLMEngine

    with pytest.raises(RuntimeError, match="needs vLLM"):
        VLLMEngine(tiny_models["qwen2"], WeightFeed(1, 0, 384, 300), max_model_len=64)


def test_embedded_places_non_strided_checkpoint_tensors_by_index():
    from verl_mega.rollout.embedded import _locate

    param = torch.zeros(6)
    interleaved = torch.tensor([0, 2, 4, 1, 3, 5])  # no single stride reaches these elements
    target = _locate("w", param.numel(), interleaved)
    assert target.flat_index is not None
    target.copy_(param, torch.tensor([10.0, 12.0, 14.0, 11.0, 13.0, 15.0]))
    assert param.tolist() == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    window = _locate("w", param.numel(), torch.arange(6).view(2, 3).t())
    assert window.flat_index is None and window.stride == (1, 3)


def test_renamed_parameters_skip_the_probe_and_land_where_the_probe_puts_them(tiny_models):
    """Every family's tiny model: the shortcut for parameters the reverse conversion only renames gives the same
    checkpoint names and places as probing every parameter with element indices (fused MoE experts still probed)."""
    from transformers import AutoModelForCausalLM

    from verl_mega.models.builder import checkpoint_tensors
    from verl_mega.rollout.embedded import _checkpoint_targets, _probed_targets

    shortcut_taken = 0
    for family, hf_dir in tiny_models.items():
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        probed = {}
        for name, param in checkpoint_tensors(model).items():  # DeepSeek-V3's expert bias is a saved buffer
            probed.update(_probed_targets(model, name, param))
        targets = _checkpoint_targets(model)
        assert sorted(targets) == sorted(probed), family
        for checkpoint_name, want in probed.items():
            got = targets[checkpoint_name]
            shortcut_taken += got is not want and got.flat_index is None and got.offset == 0
            assert got.param_name == want.param_name and got.shape == want.shape, checkpoint_name
            if want.flat_index is None:  # a size-1 dimension's stride steps nowhere: compare the others
                strides = [(g, w) for g, w, size in zip(got.stride, want.stride, want.shape) if size > 1]
                assert all(g == w for g, w in strides) and got.offset == want.offset, checkpoint_name
            assert (got.flat_index is None) == (want.flat_index is None), checkpoint_name
    assert shortcut_taken > 0
