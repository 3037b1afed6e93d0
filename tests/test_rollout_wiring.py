"""The seam between the HybridEngine and the rollout engines, without vLLM: which engine the factory picks,
and the `WeightFeed` arithmetic the engines read the stream by. (That the feed describes the real stream at
every rollout TP is checked on the stream itself in tests/workers/hybrid_worker.py.)"""
from __future__ import annotations

import pytest
import torch

from verl_mega.rollout.engine import WeightFeed
from verl_mega.rollout.factory import choose_engine


@pytest.mark.parametrize("engine,rollout_tp,prefer_vllm,chosen", [
    ("vllm", 1, False, "vllm"), ("vllm", 2, False, "vllm"), ("auto", 2, True, "vllm"), ("auto", 1, True, "vllm"),
    ("auto", 1, False, "embedded"), ("embedded", 1, True, "embedded"),
])
def test_factory_picks_the_engine(engine, rollout_tp, prefer_vllm, chosen):
    assert choose_engine(engine, rollout_tp, prefer_vllm) == chosen


@pytest.mark.parametrize("engine,prefer_vllm", [("embedded", True), ("auto", False)])
def test_factory_refuses_sliced_weights_for_the_embedded_engine(engine, prefer_vllm):
    with pytest.raises(ValueError, match="embedded rollout engine runs at rollout_tp=1.*parallel.rollout_tp=2"):
        choose_engine(engine, 2, prefer_vllm)


def test_factory_refuses_an_unknown_engine():
    with pytest.raises(ValueError, match="rollout.engine must be one of auto, embedded, vllm, got 'sglang'"):
        choose_engine("sglang", 1, True)


@pytest.mark.parametrize("vocab_size,train_tp,rollout_tp", [(300, 2, 2), (300, 4, 2), (151936, 2, 2), (64, 4, 4)])
def test_feed_vocab_rows_cover_the_vocabulary_once(vocab_size, train_tp, rollout_tp):
    padded = -(-vocab_size // (128 * train_tp)) * 128 * train_tp  # megatron's padding
    feed = WeightFeed(rollout_tp, 0, padded, vocab_size)
    rows = [feed.vocab_rows(part) for part in range(rollout_tp)]
    assert [row for part in rows for row in part] == list(range(vocab_size))
    assert all(len(part) <= padded // rollout_tp for part in rows)
    assert feed.presliced


def test_feed_at_rollout_tp1_is_whole():
    feed = WeightFeed(1, 0, 384, 300)
    assert not feed.presliced and feed.vocab_rows(0) == range(300)


def test_cpu_kv_cache_budget_is_what_the_sequences_need():
    from verl_mega.models.hf_config import HFModelConfig
    from verl_mega.rollout.vllm_engine import kv_cache_bytes

    cfg = HFModelConfig.from_dict(dict(model_type="llama", hidden_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                                       vocab_size=300, max_position_embeddings=64))
    # keys and values x layers x kv heads x head_dim x bytes x tokens
    assert kv_cache_bytes(cfg, torch.bfloat16, 10) == 2 * 2 * 2 * 32 * 2 * 10
