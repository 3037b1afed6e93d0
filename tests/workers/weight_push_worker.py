"""torchrun worker for tests/test_weight_push.py: 4 processes, ranks 0-1 training at TP 2, ranks 2-3 rollout only.

    weight_push_worker HF_DIR CKPT_DIR OUT_DIR TIMEOUT_S HANG_TIMEOUT_S

The cases run in turn in the same processes (one start-up):
- `bridge`: objects point to point, tensors broadcast over every rank and over a subset;
- `push_tp1`: rollout TP 1 (two replicas), each loading an embedded engine straight from the push; its
  parameters must equal the HF checkpoint and carry the checksums of the colocated HybridEngine stream;
- `push_tp2`: after a stand-in training step, rollout TP 2 (one replica): each rank's received slice must equal
  the checkpoint's slice for its rollout TP rank plus the step, and the colocated stream's checksums;
- `corrupt`: rank 2's bridge flips one byte of the push; verify must name the first tensor on both sides;
- `peer_dies`: rank 3 exits after the push began; training rank 1 must raise PeerFailed naming it;
- `peer_hangs`: rank 2 stays silent; training rank 0, waiting HANG_TIMEOUT_S for it, must raise PeerFailed
  naming it (then rank 1 lets rank 2 go).
Each rank writes OUT_DIR/rank{N}.json with what it saw; an assertion failing in a case names the case.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.workers.hybrid_worker import expected_rollout_slice
from verl_mega.checkpoint.manifest import Manifest
from verl_mega.checkpoint.model_io import build_model_from_checkpoint
from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.models import HFModelConfig, family_for
from verl_mega.models.builder import checkpoint_tensors
from verl_mega.parallel.bridge import PeerFailed, init_placement
from verl_mega.parallel.placement import placement_for, rollout_peer, weight_routes
from verl_mega.parallel.process_exit import exit_process
from verl_mega.parallel.state import destroy_parallel, init_parallel
from verl_mega.rollout.embedded import EmbeddedEngine
from verl_mega.rollout.hybrid_engine import HybridEngine
from verl_mega.rollout.weight_push import (
    WeightMismatch, push_weights, receive_weights, rollout_feed, tensor_checksum, weight_checksums,
)

TRAIN_TP = 2
BUCKET_MB = 0.05  # a few buckets of the tiny model, so that packing across buckets is exercised
STEP_SHIFT = 0.5


class CorruptingBridge:
    """The bridge, with one byte of the first weight tensor it receives flipped (a planted transport fault)."""

    def __init__(self, bridge):
        self._bridge, self._armed = bridge, True

    def __getattr__(self, name):
        return getattr(self._bridge, name)

    def recv_tensor(self, tensor, src):
        received = self._bridge.recv_tensor(tensor, src)
        if self._armed and received.is_floating_point():
            received.view(torch.uint8)[0] ^= 1
            self._armed = False
        return received


def training_rank(bridge, placement, ckpt: Path, report: dict) -> None:
    init_parallel(TRAIN_TP)
    model, _, cfg, family = build_model_from_checkpoint(ckpt)
    engines = {rollout_tp: HybridEngine(model, cfg, family, rollout_tp) for rollout_tp in (1, 2)}

    def push(rollout_tp: int, version: int, **kwargs):
        """Push, then send each target what the colocated stream of this rank holds, for comparison."""
        at = dataclasses.replace(placement, rollout_tp=rollout_tp)
        push_weights(bridge, engines[rollout_tp], at, version, BUCKET_MB, **kwargs)
        colocated = weight_checksums(engines[rollout_tp].stream())
        for route in weight_routes(at):
            if route.source == placement.global_rank:
                bridge.send_object(colocated, route.target)

    push(1, version=1, verify=True)
    with torch.no_grad():
        for tensor in checkpoint_tensors(model).values():
            tensor.add_(STEP_SHIFT)
    push(2, version=2)
    try:
        push_weights(bridge, engines[1], dataclasses.replace(placement, rollout_tp=1), 3, BUCKET_MB, verify=True)
    except WeightMismatch as error:
        report["corrupt"] = str(error)
    started = time.monotonic()
    try:
        push_weights(bridge, engines[2], dataclasses.replace(placement, rollout_tp=2), 4, BUCKET_MB)
        report["peer_dies"] = None
    except PeerFailed as error:
        report["peer_dies"] = str(error)
    report["peer_dies_after_s"] = time.monotonic() - started
    peer_hangs(bridge, placement, report)


def peer_hangs(bridge, placement, report: dict) -> None:
    """Rank 0 waits for a word rank 2 never sends, under a short timeout; rank 1 releases rank 2 afterwards."""
    if placement.global_rank == 0:
        bridge.timeout = datetime.timedelta(seconds=report["hang_timeout_s"])
        started = time.monotonic()
        try:
            bridge.recv_object(2)
            report["peer_hangs"] = None
        except PeerFailed as error:
            report["peer_hangs"] = str(error)
        report["peer_hangs_after_s"] = time.monotonic() - started
    dist.barrier()  # the training world: rank 0 is through
    if placement.global_rank == 1:
        bridge.send_object("done", 2)


def rollout_rank(bridge, placement, hf_dir: Path, ckpt: Path, report: dict) -> None:
    manifest = Manifest.read(ckpt)
    cfg = HFModelConfig.from_dict(manifest.hf_config)
    family = family_for(cfg, manifest.family_spec, ckpt, recorded=True)
    padded_vocab = manifest.padded_vocab_size
    reader = SafetensorsReader(hf_dir)
    me = placement.global_rank

    at = dataclasses.replace(placement, rollout_tp=1)
    version, stream = receive_weights(bridge, at, BUCKET_MB)
    engine = EmbeddedEngine(cfg.raw)
    engine.load_weights(stream)
    colocated = bridge.recv_object(rollout_peer(at, me).source)
    held = checkpoint_tensors(engine.model)
    expected = expected_rollout_slice(reader, cfg, family, padded_vocab, 0, 1, 0.0)
    assert version == 1 and stream.verified and stream.feed == rollout_feed(at, padded_vocab, cfg.vocab_size), (
        version, stream.feed)
    for name, want in expected.items():
        assert torch.equal(held[name], want), f"push_tp1 rank {me}: '{name}' differs from the checkpoint"
        assert tensor_checksum(held[name]) == colocated[name], f"push_tp1 rank {me}: '{name}' checksum"

    at = dataclasses.replace(placement, rollout_tp=2)
    version, stream = receive_weights(bridge, at, BUCKET_MB)
    received = {name: tensor.clone() for name, tensor in stream}
    colocated = bridge.recv_object(rollout_peer(at, me).source)
    rollout_tp_rank = at.rollout_coordinates(me).rollout_tp_rank
    expected = expected_rollout_slice(reader, cfg, family, padded_vocab, rollout_tp_rank, 2, STEP_SHIFT)
    assert version == 2 and not stream.verified and stream.feed == rollout_feed(at, padded_vocab, cfg.vocab_size), (
        version, stream.feed)
    assert set(received) == set(expected) == set(colocated), f"push_tp2 rank {me}: names differ"
    for name, want in expected.items():
        assert torch.equal(received[name], want), f"push_tp2 rank {me}: '{name}' differs from the checkpoint slice"
        assert tensor_checksum(received[name]) == colocated[name], f"push_tp2 rank {me}: '{name}' checksum"
    report["received_tp2"] = weight_checksums(received.items())

    at = dataclasses.replace(placement, rollout_tp=1)
    wire = CorruptingBridge(bridge) if me == 2 else bridge
    _, stream = receive_weights(wire, at, BUCKET_MB)
    names = []
    try:
        for name, _ in stream:
            names.append(name)
    except WeightMismatch as error:
        report["corrupt"] = str(error)
    report["first_tensor"] = names[0]

    _, stream = receive_weights(bridge, dataclasses.replace(placement, rollout_tp=2), BUCKET_MB)
    if me == 3:  # dies mid-protocol: the header is in, the tensors are not
        write_report(report, me)
        os._exit(0)
    for _ in stream:
        pass
    assert bridge.recv_object(1) == "done", "peer_hangs: rank 1's release"


def bridge_case(bridge, placement) -> None:
    me = placement.global_rank
    if me == 0:
        bridge.send_object({"from": 0, "to": 3}, 3)
    if me == 3:
        assert bridge.recv_object(0) == {"from": 0, "to": 3}, "bridge: object 0 -> 3"
    whole = bridge.broadcast_tensor(torch.full((3,), float(me)), 2, range(4))
    assert torch.equal(whole, torch.full((3,), 2.0)), f"bridge: broadcast over all ranks on {me}: {whole}"
    if me in (1, 3):
        part = bridge.broadcast_tensor(torch.full((2,), float(me)), 1, (1, 3))
        assert torch.equal(part, torch.full((2,), 1.0)), f"bridge: broadcast over (1, 3) on {me}: {part}"


def write_report(report: dict, rank: int) -> None:
    Path(report["out"], f"rank{rank}.json").write_text(json.dumps(report))


def main(argv: list[str]) -> None:
    hf_dir, ckpt, out = Path(argv[0]), Path(argv[1]), argv[2]
    timeout_s, hang_timeout_s = float(argv[3]), float(argv[4])
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    placement = placement_for(rank, size, 2, 1, TRAIN_TP)
    bridge = init_placement(placement, timeout_minutes=5, bridge_timeout_s=timeout_s)
    report = {"out": out, "role": placement.role, "pid": os.getpid(), "rank_in_role": placement.rank_in_role,
              "hang_timeout_s": hang_timeout_s}
    bridge_case(bridge, placement)
    if placement.role == "train":
        training_rank(bridge, placement, ckpt, report)
    else:
        rollout_rank(bridge, placement, hf_dir, ckpt, report)
    write_report(report, rank)
    bridge.close()
    destroy_parallel()


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
