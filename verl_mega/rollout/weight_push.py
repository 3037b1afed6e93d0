"""Weight push: the training ranks' HybridEngine stream, sent over the bridge to the rollout ranks in buckets.

After an optimizer step every training rank streams the HybridEngine at the rollout TP (its collectives need
all of them); the rank `placement.weight_routes` names for a rollout rank sends it its rollout TP slice, so each
rollout rank receives exactly the `WeightFeed` layout of its rollout TP rank and feeds `load_weights` with it.

On the wire, per bucket: a JSON header (version, the sender's feed, each tensor's name, dtype and shape), then
one flat tensor per dtype holding the bucket's tensors of that dtype back to back. A bucket holds at most
`parallel.weight_push_bucket_mb` (a larger tensor travels alone), so either side holds one bucket beyond the
stream's own tensor, never the model, and nothing touches a disk. A closing header carries the tensor count and,
with `verify`, the sender's `weight_checksums`; the rollout rank answers with its count and checksums, so a
push ends only when both sides have it all, and a mismatch is raised on both sides naming the first tensor.

The receiver treats every header as hostile: dtypes from a fixed list, shapes of non-negative integers, a bucket
no larger than the bucket size (or one tensor), names not seen before in the push.
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from verl_mega.parallel.bridge import Bridge, PeerFailed
from verl_mega.parallel.layout import RolePlacement
from verl_mega.parallel.placement import rollout_peer, weight_routes

from .engine import WeightFeed
from .hybrid_engine import HybridEngine

WIRE_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class WeightMismatch(ValueError):
    """A pushed tensor arrived different from what was sent (the message names it)."""


def weight_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """name -> an exact digest of each tensor's bytes (`tensor_checksum`)."""
    return {name: tensor_checksum(tensor) for name, tensor in named_tensors}


def tensor_checksum(tensor: torch.Tensor) -> str:
    """The byte count and CRC-32 of the tensor's bytes: any change of up to 32 consecutive bits is caught for
    certain, any other with odds of 2**-32. Read on the host (a GPU tensor is copied there first): zlib's CRC
    took 0.5 s for 200 MB where a position-weighted word sum in torch took 6.9 s, on the same busy CPU."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return f"{data.numel()}:{zlib.crc32(memoryview(data.numpy())):08x}"


def push_weights(bridge: Bridge, hybrid: HybridEngine, placement: RolePlacement, version: int, bucket_mb: float,
                 verify: bool = False) -> int:
    """On every training rank, after an optimizer step: stream `hybrid` (at the rollout ranks' rollout TP) and
    send this rank's slice to the rollout ranks it serves. Returns how many tensors both sides checked alike
    (with `verify`; over every rollout rank this one served, else 0). Raises PeerFailed naming a rollout rank that
    died or hung, WeightMismatch (with `verify`) naming the first tensor a rollout rank holds differently."""
    if hybrid.rollout_tp != placement.rollout_tp:
        raise ValueError(f"the HybridEngine streams rollout TP {hybrid.rollout_tp} but the rollout ranks run "
                         f"parallel.rollout_tp={placement.rollout_tp}")
    targets = [route.target for route in weight_routes(placement) if route.source == placement.global_rank]
    feed = hybrid.feed
    header = {"version": int(version), "verify": bool(verify),
              "feed": [feed.rollout_tp, feed.rollout_tp_rank, feed.padded_vocab, feed.vocab_size]}
    sent: dict[str, str] = {}
    count = 0
    for bucket in _buckets(hybrid.stream(), _bucket_bytes(bucket_mb)):
        count += len(bucket.tensors)
        if not targets:
            continue  # this rank's stream feeds the others' collectives only
        if verify:
            sent.update(weight_checksums(bucket.tensors))
        message = json.dumps({**header, "tensors": bucket.entries}).encode()
        for target in targets:
            bridge.send_bytes(message, target)
            for flat in bucket.flats:
                bridge.send_tensor(flat, target)
    for target in targets:
        bridge.send_bytes(json.dumps({**header, "end": count, "checksums": sent if verify else None}).encode(), target)
    for target in targets:
        answer = _decode(bridge.recv_bytes(target), bridge, target)
        _check_answer(answer, count, sent if verify else None, placement.global_rank, target, version)
    return len(sent) * len(targets)


def rollout_feed(placement: RolePlacement, padded_vocab: int, vocab_size: int) -> WeightFeed:
    """The `WeightFeed` a rollout rank's engine is built with, before any push (`padded_vocab`: the actor
    checkpoint manifest's padded_vocab_size)."""
    rollout_tp_rank = placement.rollout_coordinates(placement.global_rank).rollout_tp_rank
    return WeightFeed(placement.rollout_tp, rollout_tp_rank, padded_vocab, vocab_size)


def receive_weights(bridge: Bridge, placement: RolePlacement, bucket_mb: float) -> tuple[int, "WeightStream"]:
    """On a rollout rank: wait for the next push (up to the bridge timeout) and return its version and the
    `(hf_name, tensor)` iterator of this rank's slice, for `RolloutEngine.load_weights`. Consume it fully: its
    end answers the sender. A tensor is valid until the next one is drawn. Whether the push is verified is the
    sender's choice (`push_weights(verify=...)`), carried in its header."""
    source = rollout_peer(placement, placement.global_rank).source
    first = _decode(bridge.recv_bytes(source), bridge, source)
    stream = WeightStream(bridge, placement, source, first, _bucket_bytes(bucket_mb))
    return stream.version, stream


class WeightStream:
    """One push as the rollout rank receives it: iterate for `(hf_name, tensor)`; `feed` is the sender's."""

    def __init__(self, bridge: Bridge, placement: RolePlacement, source: int, first: dict, bucket_bytes: int):
        self.bridge, self.placement, self.source = bridge, placement, source
        self.version = _field(first, "version", int, bridge, source)
        self.verified = _field(first, "verify", bool, bridge, source)
        feed = _field(first, "feed", list, bridge, source)
        if len(feed) != 4 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in feed):
            raise PeerFailed(f"{bridge.peers[source]} sent a weight feed {str(feed)[:100]} that is not 4 counts")
        self.feed = WeightFeed(*feed)
        self._first, self._bucket_bytes = first, bucket_bytes

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        header, seen, received = self._first, set(), {}
        while "end" not in header:
            for name, tensor in self._bucket(header, seen):
                if self.verified:
                    received[name] = tensor_checksum(tensor)
                yield name, tensor
            header = self._next_header()
        announced = _field(header, "end", int, self.bridge, self.source)
        self.bridge.send_bytes(json.dumps({"received": len(seen),
                                           "checksums": received if self.verified else None}).encode(), self.source)
        if announced != len(seen):
            raise PeerFailed(f"weight push version {self.version}: {self.bridge.peers[self.source]} announced "
                             f"{announced} tensors, {len(seen)} arrived")
        if self.verified:
            sent = _field(header, "checksums", dict, self.bridge, self.source)
            _compare(sent, received, self.source, self.placement.global_rank, self.version)

    def _next_header(self) -> dict:
        header = _decode(self.bridge.recv_bytes(self.source), self.bridge, self.source)
        if _field(header, "version", int, self.bridge, self.source) != self.version:
            raise PeerFailed(f"{self.bridge.peers[self.source]} switched from weight version {self.version} to "
                             f"{header['version']} within one push")
        return header

    def _bucket(self, header: dict, seen: set) -> Iterator[tuple[str, torch.Tensor]]:
        entries = _entries(header, self.bridge, self.source)
        size = sum(numel * dtype.itemsize for _, dtype, _, numel in entries)
        if size > self._bucket_bytes and len(entries) > 1:
            raise PeerFailed(f"{self.bridge.peers[self.source]} sent a bucket of {size} bytes, more than "
                             f"parallel.weight_push_bucket_mb allows ({self._bucket_bytes}): is it configured alike?")
        flats = {}
        for dtype in _dtype_order(dtype for _, dtype, _, _ in entries):
            numel = sum(n for _, d, _, n in entries if d == dtype)
            flats[dtype] = self.bridge.recv_tensor(torch.empty(numel, dtype=dtype, device=self.bridge.device),
                                                   self.source)
        offsets = dict.fromkeys(flats, 0)
        for name, dtype, shape, numel in entries:
            if name in seen:
                raise PeerFailed(f"{self.bridge.peers[self.source]} sent '{name}' twice in weight version "
                                 f"{self.version}")
            seen.add(name)
            start = offsets[dtype]
            offsets[dtype] = start + numel
            yield name, flats[dtype][start:start + numel].view(shape)


# --- the wire format ----------------------------------------------------------------------------------------

def _bucket_bytes(bucket_mb: float) -> int:
    """Bytes of a bucket of `bucket_mb` MiB (a fraction of one where a test wants several buckets of a tiny
    model)."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise ValueError(f"parallel.weight_push_bucket_mb must be > 0, got {bucket_mb!r}")
    return max(1, int(bucket_mb * (1 << 20)))


@dataclass
class _Bucket:
    """Consecutive tensors of the stream packed into one flat buffer per dtype (in order of first appearance)."""

    tensors: list[tuple[str, torch.Tensor]]  # views into `flats`
    entries: list[list]  # [name, dtype name, shape] of each, the header's
    flats: list[torch.Tensor]


def _buckets(stream: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[_Bucket]:
    """The stream in buckets of at most `limit` bytes (a larger tensor alone), each tensor copied into its
    bucket's buffer before the next is drawn, as the stream's validity rule asks. The buffers are reused from one
    bucket to the next: a bucket is sent (the bridge's calls block until done) before the next is packed."""
    buffers: dict[torch.dtype, torch.Tensor] = {}
    pending: list[tuple[str, torch.Tensor]] = []
    used: dict[torch.dtype, int] = {}
    size = 0
    for name, tensor in stream:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > limit:
            yield _packed(pending, buffers, used)
            pending, used, size = [], {}, 0
        dtype, start = tensor.dtype, used.get(tensor.dtype, 0)
        buffer = buffers.get(dtype)
        if buffer is None or buffer.numel() < start + tensor.numel() or buffer.device != tensor.device:
            # Doubling up to the bucket size, not the bucket size at once: a bucket size far beyond the weights
            # (parallel.weight_push_bucket_mb is the user's) allocates only what the stream holds.
            held = 0 if buffer is None else buffer.numel()
            wanted = max(start + tensor.numel(), min(2 * held, limit // tensor.element_size()))
            buffer = buffers[dtype] = _grown(buffer, wanted, start, tensor)
        view = buffer[start:start + tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        pending.append((name, view))
        used[dtype] = start + tensor.numel()
        size += nbytes
    if pending:
        yield _packed(pending, buffers, used)


def _grown(buffer: torch.Tensor | None, numel: int, keep: int, like: torch.Tensor) -> torch.Tensor:
    """A buffer of `numel` elements holding the first `keep` of `buffer` (the bucket's tensors packed so far; the
    views of them already taken keep the old buffer alive until the bucket is sent)."""
    grown = torch.empty(numel, dtype=like.dtype, device=like.device)
    if keep:
        grown[:keep].copy_(buffer[:keep])
    return grown


def _packed(pending: list[tuple[str, torch.Tensor]], buffers: dict, used: dict) -> _Bucket:
    order = _dtype_order(tensor.dtype for _, tensor in pending)
    return _Bucket(pending, [[name, _dtype_name(tensor), list(tensor.shape)] for name, tensor in pending],
                   [buffers[dtype][:used[dtype]] for dtype in order])


def _dtype_order(dtypes: Iterable[torch.dtype]) -> list[torch.dtype]:
    return list(dict.fromkeys(dtypes))


def _dtype_name(tensor: torch.Tensor) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in WIRE_DTYPES:
        raise ValueError(f"the weight push carries {', '.join(WIRE_DTYPES)}, not {tensor.dtype}")
    return name


def _decode(data: bytes, bridge: Bridge, source: int) -> dict:
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PeerFailed(f"{bridge.peers[source]} sent a weight push message that is not JSON: {error}") from None
    if not isinstance(message, dict):
        raise PeerFailed(f"{bridge.peers[source]} sent a weight push message that is not a JSON object")
    return message


def _field(message: dict, key: str, kind: type, bridge: Bridge, source: int):
    value = message.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise PeerFailed(f"{bridge.peers[source]} sent a weight push header whose '{key}' is {value!r}")
    return value


def _entries(header: dict, bridge: Bridge, source: int) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    """(name, dtype, shape, numel) of each tensor a header announces, each part checked."""
    entries = []
    for entry in _field(header, "tensors", list, bridge, source):
        valid = (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[1] in WIRE_DTYPES
                 and isinstance(entry[2], list)
                 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry[2]))
        if not valid:
            raise PeerFailed(f"{bridge.peers[source]} sent a malformed weight push entry {str(entry)[:200]}")
        shape = tuple(entry[2])
        entries.append((entry[0], WIRE_DTYPES[entry[1]], shape, _numel(shape)))
    return entries


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _check_answer(answer: dict, count: int, sent: dict | None, source: int, target: int, version: int) -> None:
    if answer.get("received") != count:
        raise PeerFailed(f"weight push version {version}: rollout rank {target} received {answer.get('received')!r} "
                         f"of the {count} tensors training rank {source} sent")
    if sent is not None:
        _compare(sent, answer.get("checksums") or {}, source, target, version)


def _compare(sent: dict, received: dict, source: int, target: int, version: int) -> None:
    for name, digest in sent.items():
        if received.get(name) != digest:
            raise WeightMismatch(f"weight push version {version}: '{name}' differs between training rank {source} "
                                 f"(checksum {digest}) and rollout rank {target} (checksum {received.get(name)})")
    extra = sorted(set(received) - set(sent))
    if extra:
        raise WeightMismatch(f"weight push version {version}: rollout rank {target} holds '{extra[0]}', which "
                             f"training rank {source} did not send")
