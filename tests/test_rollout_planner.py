"""The transition planner: figures that add up, and impossible layouts refused with the reason."""
from __future__ import annotations

import pytest

from verl_mega.rollout.planner import main, plan


def test_rollout_bytes_add_up_to_the_model(tiny_models):
    full = plan(tiny_models["llama"], 2, 2, 1, 1)
    assert all(rank.rollout_bytes == full.model_bytes for rank in full.ranks)
    halves = plan(tiny_models["llama"], 2, 2, 1, 2)
    by_rollout_rank = {rank.rollout_tp_rank: rank.rollout_bytes for rank in halves.ranks}
    # Split tensors are halved; norms are replicated on both rollout ranks; the padded vocabulary tail
    # makes the second half smaller.
    assert all(held < full.model_bytes for held in by_rollout_rank.values())
    assert sum(by_rollout_rank.values()) >= full.model_bytes


def test_only_the_micro_dp_group_gathers(tiny_models):
    keep_training_slices = plan(tiny_models["qwen2"], 2, 1, 2, 2)
    assert all(rank.send_bytes == rank.recv_bytes == 0 for rank in keep_training_slices.ranks)
    gather = plan(tiny_models["qwen2"], 2, 1, 1, 1)
    assert all(rank.recv_bytes > 0 for rank in gather.ranks)


def test_tied_embedding_counted_once(tiny_models):
    qwen2 = plan(tiny_models["qwen2"], 1, 2, 1, 1)
    assert qwen2.ranks[0].rollout_bytes == qwen2.model_bytes


@pytest.mark.parametrize("layout, reason", [
    ((2, 1, 1, 3), "must divide the training TP size --train-tp=2"),
    ((4, 1, 1, 1), "num_key_value_heads=2"),
    ((1, 3, 1, 1), "num_hidden_layers=4"),
    ((1, 1, 0, 1), "--dp must be >= 1"),
    ((1, 1, 99999999999, 1), "= 99999999999 ranks; a plan lists each rank, up to 65536"),  # still running after 300 s
])
def test_impossible_layouts_refused(tiny_models, layout, reason):
    with pytest.raises(ValueError, match=reason):
        plan(tiny_models["llama"], *layout)


def test_cli_prints_every_rank(tiny_models, capsys):
    main(["--hf", str(tiny_models["mixtral"]), "--train-tp", "2", "--train-pp", "2", "--dp", "2", "--rollout-tp", "1"])
    out = capsys.readouterr().out
    assert "rollout tp=1" in out and len(out.strip().splitlines()) == 2 + 8
    with pytest.raises(SystemExit) as exit_info:
        main(["--hf", str(tiny_models["mixtral"]), "--train-tp", "2", "--train-pp", "1", "--dp", "1",
              "--rollout-tp", "4"])
    assert exit_info.value.code == 2
    assert "impossible layout" in capsys.readouterr().err


def test_cli_blames_a_broken_model_folder_not_the_layout(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        main(["--hf", str(tmp_path), "--train-tp", "1", "--train-pp", "1", "--dp", "1", "--rollout-tp", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "impossible layout" not in err
    assert err.startswith(f"verl-mega plan: error: {tmp_path}/config.json is not valid JSON")


def test_training_bytes_include_the_tied_output_copy(tiny_models):
    first, last = plan(tiny_models["qwen2"], 1, 2, 1, 1).ranks
    # Both stages hold the (padded) table, as embedding and as output layer; the last also the final norm.
    assert last.train_bytes - first.train_bytes == 64 * 4
    assert first.train_bytes > 384 * 64 * 4


def test_a_lora_rank_training_would_refuse_is_refused_by_the_plan_too(tiny_models):
    with pytest.raises(ValueError, match="^lora.rank=99999 does not fit"):
        plan(tiny_models["llama"], 1, 1, 1, 1, lora_rank=99999, lora_targets=["linear_qkv"])
    with pytest.raises(ValueError, match="^lora.targets: q_proj unknown"):
        plan(tiny_models["llama"], 1, 1, 1, 1, lora_rank=2, lora_targets=["q_proj"])


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_quantized_rollout_holds_what_the_quantized_stream_carries(tiny_models, family, fmt):
    """The planned rollout bytes at rollout TP 1 are the bytes of the quantized stream of the checkpoint's tensors."""
    from verl_mega.checkpoint.safetensors_io import SafetensorsReader
    from verl_mega.rollout.quantization import quantized_stream

    reader = SafetensorsReader(tiny_models[family])
    streamed = sum(t.numel() * t.element_size() for _, t in quantized_stream(
        ((name, reader.read(name)) for name in reader.names()), fmt))
    quantized = plan(tiny_models[family], 2, 1, 1, 1, quantization=fmt)
    plain = plan(tiny_models[family], 2, 1, 1, 1)
    assert all(rank.rollout_bytes == streamed < plain.ranks[0].rollout_bytes for rank in quantized.ranks)
    # quantizing a tensor holds fp32 copies of it beside the transfer buffers
    assert quantized.ranks[0].transition_peak_bytes > plain.ranks[0].transition_peak_bytes
