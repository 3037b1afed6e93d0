"""Weight push over the bridge, under real gloo processes: training TP 2 on ranks 0-1, two rollout-only ranks 2-3.

One torchrun launch of tests/workers/weight_push_worker.py runs every case in turn (see its docstring): at rollout TP 1
(two replicas, each loading an embedded engine from the push) and at rollout TP 2 (one replica) every rollout
rank holds bit for bit what the colocated HybridEngine stream gives at its rollout TP rank; a flipped byte is
named by verify on both sides; a rollout rank that exits mid-push is named by the training rank it served, and
one that stays silent is named once the bridge's timeout has passed."""
from __future__ import annotations

import json
import subprocess

import pytest

from verl_mega.parallel.spawn import run_torchrun

TIMEOUT_S = 120  # the bridge's wait: long enough for a loaded machine's start-up, a dead peer is seen at once
HANG_TIMEOUT_S = 2  # rank 0's wait for a silent rank 2
TEST_SIZES = dict(num_hidden_layers=2)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[int, dict]:
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("weight_push")
    hf_dir = make_tiny_hf_model(root / "hf", "llama", **TEST_SIZES)
    ckpt = root / "ckpt"
    convert_hf_to_mcore(hf_dir, ckpt, tp=2)
    out = root / "out"
    out.mkdir()
    try:
        run_torchrun(4, "tests.workers.weight_push_worker",
                     [str(hf_dir), str(ckpt), str(out), str(TIMEOUT_S), str(HANG_TIMEOUT_S)], capture_output=True)
    except subprocess.CalledProcessError as failed:
        pytest.fail(f"the weight push launch failed:\n{(failed.stdout or '')[-3000:]}\n{(failed.stderr or '')[-6000:]}")
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)}


@pytest.mark.slow
def test_each_rollout_rank_holds_the_colocated_stream_of_its_rollout_tp_rank(reports):
    # The worker compared every tensor with the checkpoint and the colocated stream's checksums; here, what the
    # two rollout TP ranks of the one replica hold differs (each its own slice) and both ranks got there.
    assert [reports[rank]["role"] for rank in range(4)] == ["train", "train", "rollout", "rollout"]
    assert reports[2]["received_tp2"].keys() == reports[3]["received_tp2"].keys()
    assert reports[2]["received_tp2"] != reports[3]["received_tp2"]


@pytest.mark.slow
def test_a_flipped_byte_is_named_on_both_sides(reports):
    first = reports[2]["first_tensor"]
    for rank in (0, 2):
        assert f"'{first}' differs between training rank 0" in reports[rank]["corrupt"], reports[rank]["corrupt"]
        assert "and rollout rank 2" in reports[rank]["corrupt"]
    assert "corrupt" not in reports[1] and "corrupt" not in reports[3]


@pytest.mark.slow
def test_a_rollout_rank_that_dies_mid_push_is_named_within_the_timeout(reports):
    message = reports[1]["peer_dies"]
    assert message is not None and message.startswith(f"rollout rank 3 (pid {reports[3]['pid']} on "), message
    assert "\n" not in message
    assert reports[1]["peer_dies_after_s"] < TIMEOUT_S
    assert reports[0]["peer_dies"] is None  # its own rollout rank was served in full


@pytest.mark.slow
def test_a_rollout_rank_that_stays_silent_is_named_after_the_timeout(reports):
    message = reports[0]["peer_hangs"]
    assert message is not None and message.startswith(
        f"rollout rank 2 (pid {reports[2]['pid']} on "), message
    assert f"did not answer within {HANG_TIMEOUT_S} s" in message and "\n" not in message
    assert HANG_TIMEOUT_S <= reports[0]["peer_hangs_after_s"] < TIMEOUT_S


@pytest.mark.parametrize("bucket_mb", [1e-4, 1e9])
def test_buckets_carry_the_stream_and_allocate_what_it_holds_whatever_the_bucket_size(bucket_mb):
    """A bucket size of a petabyte (parallel.weight_push_bucket_mb is the user's) packs ~20 KiB of tensors into
    buffers of at most twice that, where a buffer of the whole bucket size was allocated up front; a tiny one
    still sends every tensor, a tensor larger than the bucket alone."""
    import torch

    from verl_mega.rollout.weight_push import _bucket_bytes, _buckets

    generator = torch.Generator().manual_seed(0)
    stream = [(f"t{i}", torch.randn(i + 1, 37, generator=generator, dtype=dtype))
              for i, dtype in enumerate([torch.float32, torch.bfloat16] * 20)]
    received, largest = [], 0
    for bucket in _buckets(iter(stream), _bucket_bytes(bucket_mb)):
        largest = max([largest, *(flat.untyped_storage().nbytes() for flat in bucket.flats)])
        received += [(name, tensor.clone()) for name, tensor in bucket.tensors]
    assert [name for name, _ in received] == [name for name, _ in stream]
    assert all(torch.equal(got, sent) for (_, got), (_, sent) in zip(received, stream))
    streamed = sum(tensor.numel() * tensor.element_size() for _, tensor in stream)
    assert largest <= 2 * streamed
