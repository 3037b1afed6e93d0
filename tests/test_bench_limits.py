"""bench/limits.py's accounting: FLOPs and bytes of a tiny shape, computed by hand here (no timing)."""
import pytest

from bench.limits import (Shape, StepTokens, attention_flops, body_params, decode_bytes, decode_step_flops,
                          decode_steps, forward_flops, gemm_work, kv_bytes_per_position, outside_seconds,
                          prefill_flops, step_tokens, transition_rows, update_flops, weight_bytes)

# head_dim 4; fused q/k/v out = (2 + 2 * 1) * 4 = 16
SHAPE = Shape(hidden=8, layers=2, ffn=16, heads=2, kv_heads=1, vocab=10)


def test_body_params_are_the_projections_of_every_layer():
    # q/k/v 8x16 + o 8x8 + gate/up 8x32 + down 16x8 = 128 + 64 + 256 + 128 = 576 per layer
    assert body_params(SHAPE) == 2 * 576


def test_attention_counts_the_causal_pairs():
    # 2 layers x (q.k + p.v: 2 x 2 FLOPs x hidden 8) x 6 visible pairs of 3 positions
    assert attention_flops(SHAPE, 3) == 2 * 4 * 8 * 6


def test_forward_has_the_lm_head_at_the_response_positions_only():
    tokens = StepTokens(sequences=2, prompt=2, response=1)
    # per sequence: 2 N x 3 tokens + attention over 3 + LM head 2 x 8 x 10 at 1 position
    assert forward_flops(SHAPE, tokens) == 2 * (2 * 1152 * 3 + 384 + 160)


def test_update_is_forward_plus_twice_it_backward_per_epoch():
    tokens = StepTokens(sequences=2, prompt=2, response=1)
    assert update_flops(SHAPE, tokens) == 3 * 14912
    assert update_flops(SHAPE, tokens, epochs=2) == 6 * 14912


def test_prefill_is_the_prompts_and_one_lm_head_row():
    tokens = StepTokens(sequences=2, prompt=2, response=3)
    # attention over 2 positions: 2 layers x 4 x 8 x 3 pairs = 192
    assert prefill_flops(SHAPE, tokens) == 2 * (2 * 1152 * 2 + 192 + 160)


def test_decode_reads_the_weights_once_per_step_and_each_sequences_cache():
    tokens = StepTokens(sequences=2, prompt=2, response=3)
    assert weight_bytes(SHAPE) == (1152 + 80) * 4
    assert kv_bytes_per_position(SHAPE) == 2 * 2 * 1 * 4 * 4  # k and v, 2 layers, 1 kv head of 4, fp32
    assert decode_steps(tokens) == 2  # the prefill gave the first of the 3 tokens
    # step 1 reads 3 cached positions per sequence, step 2 reads 4: 7 per sequence, 14 in all
    assert decode_bytes(SHAPE, tokens) == 2 * 4928 + 14 * 64


def test_gemm_work_takes_the_models_shapes():
    assert gemm_work(SHAPE, rows=5, response_rows=2) == [(5, 8, 16), (5, 8, 8), (5, 8, 32), (5, 16, 8), (2, 8, 10)]


def test_shape_from_an_hf_config_without_kv_heads_is_multi_head():
    config = dict(hidden_size=8, num_hidden_layers=2, intermediate_size=16, num_attention_heads=2, vocab_size=10)
    assert Shape.from_hf_config(config).kv_heads == 2


def test_outside_is_the_step_less_its_model_stages():
    assert outside_seconds({"rollout": 1.0, "update_actor": 2.0, "reward": 0.5}, 4.0) == 1.0


def test_step_tokens_split_the_counted_tokens_into_prompts_and_responses():
    record = {"perf/tokens_per_second": 100.0, "perf/step_seconds": 2.0, "response/length_mean": 3.25}
    assert step_tokens(record) == StepTokens(32, 3.0, 3.25)


def test_a_decode_step_multiplies_every_weight_once_per_sequence():
    assert decode_step_flops(SHAPE, sequences=2) == 2 * 2 * (1152 + 80)


def test_a_transition_with_nothing_to_receive_has_no_byte_bound():
    """At training TP = rollout TP the timed transport is a barrier: its latency is no bound to set a ratio
    against, so the row says n/a and fails on the layout copies; a transition that receives bytes is judged."""
    def rank(rollout_tp, recv, seconds, bound):
        return dict(rank=0, rollout_tp=rollout_tp, recv_bytes=recv, seconds=seconds, bound_seconds=bound,
                    peak=1, peak_bound=2)

    gather, local = transition_rows([rank(1, 2 ** 20, 0.5, 0.45), rank(2, 0, 0.04, 1e-4)])
    assert gather[4] == "1.11x" and gather[5] == "PASS"
    assert local[2] == "0.000 s" and local[4] == "n/a"
    assert local[5] == "FAIL: transition: local layout copies, no bytes to receive"


def test_a_bench_module_started_as_torchrun_ranks_imports_from_the_repository(tmp_path, monkeypatch):
    """The ranks import nothing from the working folder (verl_mega.parallel.safe_path) and `bench` is not
    installed: bench.limits' transition workers (and four other benches' ranks) failed with "No module named
    'bench'" until the repository's root went on their PYTHONPATH."""
    import subprocess

    from bench import with_repo_on_path
    from verl_mega.parallel.spawn import run_torchrun

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(subprocess.CalledProcessError):
        run_torchrun(1, "bench.__init__", [], capture_output=True)
    assert run_torchrun(1, "bench.__init__", [], env=with_repo_on_path(), capture_output=True).returncode == 0
