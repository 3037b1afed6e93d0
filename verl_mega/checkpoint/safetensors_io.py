"""Streaming safetensors IO: read one tensor (or one TP slice of it) at a time; write bounded shards."""
from __future__ import annotations

import errno
import json
import math
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


_COLUMN_READ_CHUNK_BYTES = 4 * 1024**2
# Buffers one gathering write takes (Linux's IOV_MAX).
_MAX_WRITE_SEGMENTS = 1024


@dataclass(frozen=True)
class _Entry:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file


class SafetensorsReader:
    """Lazy access to an HF checkpoint folder (single file or sharded with an index).

    Reads with positioned reads into fresh tensors rather than memory-mapping, so only the bytes asked
    for are read and a converter's memory is what it holds, not the file pages it touched.
    """

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self._fds: dict[Path, int] = {}
        self._fds_lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        index = self.dir / INDEX_NAME
        if index.is_file():
            weight_map = _read_weight_map(index)
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_NAME).is_file():
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise FileNotFoundError(f"{self.dir} holds neither {SINGLE_NAME} nor {INDEX_NAME}")
        for file in files:
            path = self.dir / file
            if not path.is_file():
                raise FileNotFoundError(f"shard {path} named in {INDEX_NAME} is missing")
            for name, entry in _read_entries(path).items():
                if name in self._entries:
                    raise ValueError(f"tensor '{name}' is stored twice: in {self._entries[name].path} and {path}")
                self._entries[name] = entry
        if weight_map is not None:
            _check_weight_map(index, weight_map, self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(f"tensor '{name}' is not in the checkpoint at {self.dir}")
        return entry

    def split_rows(self, name: str, parts: Sequence[str]) -> None:
        """Present tensor `name`, seen as a matrix of its last dimension's columns, as the tensors `parts`:
        consecutive blocks of equal rows, top to bottom (an expert stack's per-expert tensors). Nothing is read:
        each part is the stacked tensor's bytes at its own offset."""
        entry = self._entry(name)
        rows = math.prod(entry.shape[:-1])
        if len(entry.shape) < 2 or rows % len(parts):
            raise ValueError(f"tensor '{name}' of shape {list(entry.shape)} does not split into {len(parts)} "
                             "blocks of whole rows")
        stored = [part for part in parts if part in self._entries]
        if stored:
            raise ValueError(f"tensor '{stored[0]}' is stored twice: on its own and inside '{name}'")
        block, columns = rows // len(parts), entry.shape[-1]
        del self._entries[name]
        for index, part in enumerate(parts):
            offset = entry.offset + index * block * columns * entry.dtype.itemsize
            self._entries[part] = _Entry(entry.path, entry.dtype, (block, columns), offset)

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name).dtype

    def read(self, name: str) -> torch.Tensor:
        entry = self._entry(name)
        return self.read_rows(name, 0, entry.shape[0] if entry.shape else 1)

    def read_rows(self, name: str, start: int, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, start + count) of dim 0, read straight into `out` when given; rows past the end
        of the tensor are zeros (megatron's padded vocabulary)."""
        entry = self._entry(name)
        shape = (count, *entry.shape[1:]) if entry.shape else ()
        if out is None:
            out = torch.empty(shape, dtype=entry.dtype)
        present = max(0, min(count, (entry.shape[0] if entry.shape else 1) - start))
        if present < count:
            out[present:] = 0
        if present:
            row_bytes = out[0].numel() * out.element_size() if entry.shape else out.element_size()
            self._pread_into(entry, entry.offset + start * row_bytes, _bytes_of(out[:present] if entry.shape else out))
        return out

    def read_part(self, name: str, dim: int, part: int, parts: int, padded_rows: int | None = None) -> torch.Tensor:
        """Part `part` of `parts` equal parts along `dim` (0 or 1), reading only those bytes.

        With `padded_rows`, dim 0 is first zero-padded to that length (megatron's padded vocabulary).
        """
        entry = self._entry(name)
        total = padded_rows if padded_rows is not None else entry.shape[dim]
        if total % parts:
            raise ValueError(f"'{name}' dim {dim} of size {total} does not split into {parts} equal parts")
        length = total // parts
        if dim == 0:
            return self.read_rows(name, part * length, length)
        if dim != 1 or len(entry.shape) != 2:
            raise ValueError(f"'{name}': only dims 0 and 1 of a matrix can be read in parts")
        rows, columns = entry.shape
        out = torch.empty((rows, length), dtype=entry.dtype)
        # Whole rows are read a few MiB at a time into one buffer and this part's columns copied out: a read
        # per row segment costs more in system calls than reading the other parts' bytes too.
        chunk_rows = max(1, _COLUMN_READ_CHUNK_BYTES // (columns * out.element_size()))
        buffer = torch.empty((min(chunk_rows, rows), columns), dtype=entry.dtype)
        for first in range(0, rows, chunk_rows):
            count = min(chunk_rows, rows - first)
            self._pread_into(entry, entry.offset + first * columns * out.element_size(), _bytes_of(buffer[:count]))
            out[first:first + count] = buffer[:count, part * length:(part + 1) * length]
        return out

    def write_piece(self, piece, fd: int, offset: int) -> int:
        """Writes the bytes of `piece` (a `sharding.HFRows`: rows of one tensor, or their column part) at
        `offset` of the open file `fd` straight from the source file, never holding the tensor: whole rows are
        one in-kernel copy, a column part goes through a few-MiB buffer. Returns the number of bytes written."""
        entry = self._entry(piece.name)
        if not entry.shape or piece.start < 0 or piece.rows < 0:
            raise ValueError(f"'{piece.name}': rows {piece.start}..{piece.start + piece.rows} of a "
                             f"{list(entry.shape)} tensor cannot be copied")
        row_elements = math.prod(entry.shape[1:])
        if row_elements % piece.parts:
            raise ValueError(f"'{piece.name}' rows of {row_elements} elements do not split into {piece.parts} parts")
        itemsize = entry.dtype.itemsize
        row_bytes, part_bytes = row_elements * itemsize, row_elements // piece.parts * itemsize
        present = max(0, min(piece.rows, entry.shape[0] - piece.start))
        source = entry.offset + piece.start * row_bytes
        if piece.parts == 1:
            _copy_bytes(self._fd(entry), source, fd, offset, present * row_bytes, entry.path)
        else:
            # Per-row in-kernel copies cost more in system calls than a read of every column: rows are read a
            # few MiB at a time and this part's segments written in one gathering write.
            chunk_rows = min(max(1, _COLUMN_READ_CHUNK_BYTES // row_bytes), _MAX_WRITE_SEGMENTS)
            buffer = memoryview(bytearray(min(chunk_rows, present) * row_bytes))
            segments = [buffer[row * row_bytes + piece.part * part_bytes:][:part_bytes] for row in range(chunk_rows)]
            for first in range(0, present, chunk_rows):
                count = min(chunk_rows, present - first)
                self._pread_into(entry, source + first * row_bytes, buffer[:count * row_bytes])
                pwrite_all(fd, segments[:count], offset + first * part_bytes)
        _write_zeros(fd, offset + present * part_bytes, (piece.rows - present) * part_bytes)
        return piece.rows * part_bytes

    def _fd(self, entry: _Entry) -> int:
        with self._fds_lock:  # pieces are written from several threads
            fd = self._fds.get(entry.path)
            if fd is None:
                fd = self._fds[entry.path] = os.open(entry.path, os.O_RDONLY)
            return fd

    def _pread_into(self, entry: _Entry, offset: int, buffer) -> None:
        if os.preadv(self._fd(entry), [buffer], offset) != buffer.nbytes:
            raise ValueError(f"{entry.path} ended early while reading a tensor: the file is truncated")

    def close(self) -> None:
        fds = getattr(self, "_fds", {})  # absent when __init__ failed before setting it
        for fd in fds.values():
            os.close(fd)
        fds.clear()

    def __del__(self):
        self.close()


def _bytes_of(tensor: torch.Tensor):
    return tensor.view(-1).view(torch.uint8).numpy()


def _copy_bytes(source_fd: int, source_offset: int, fd: int, offset: int, count: int, source: Path) -> None:
    """`count` bytes from `source_offset` of one open file to `offset` of another: in the kernel where it can
    (copy_file_range), through a bounded buffer where it cannot (another file system, an older kernel)."""
    done = 0
    while done < count:
        try:
            copied = os.copy_file_range(source_fd, fd, count - done, source_offset + done, offset + done)
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            break
        if copied == 0:
            raise ValueError(f"{source} ended early while reading a tensor: the file is truncated")
        done += copied
    buffer = bytearray(min(_COLUMN_READ_CHUNK_BYTES, count - done))
    while done < count:
        view = memoryview(buffer)[:min(len(buffer), count - done)]
        if os.preadv(source_fd, [view], source_offset + done) != len(view):
            raise ValueError(f"{source} ended early while reading a tensor: the file is truncated")
        pwrite_all(fd, view, offset + done)
        done += len(view)


def pwrite_all(fd: int, data, offset: int) -> None:
    """All of `data` (a buffer, or a list of byte memoryviews written one after the other) at `offset` of the
    open file `fd`."""
    segments = list(data) if isinstance(data, list) else [memoryview(data).cast("B")]
    while segments:
        written = os.pwritev(fd, segments, offset)
        offset += written
        while segments and written >= len(segments[0]):
            written -= len(segments[0])
            segments.pop(0)
        if segments:
            segments[0] = segments[0][written:]


def _write_zeros(fd: int, offset: int, count: int) -> None:
    zeros = bytes(min(count, _COLUMN_READ_CHUNK_BYTES))
    while count > 0:
        pwrite_all(fd, zeros[:count], offset)
        offset, count = offset + min(count, len(zeros)), count - len(zeros)


# safetensors' own limit on the JSON header; a header length past it is a corrupt or hostile file.
MAX_HEADER_BYTES = 100 * 1024**2


def _read_entries(path: Path) -> dict[str, _Entry]:
    """Parse a safetensors header, refusing anything the data bytes do not back exactly: every tensor's
    byte span equals its shape x dtype, spans tile the data without gaps or overlaps, and end at the file's end."""
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is truncated or not a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > min(MAX_HEADER_BYTES, file_size - 8):
            raise ValueError(f"{path} is corrupt: its header claims {length} bytes, the file has {file_size}")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path} has a corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_start = 8 + length
    entries, spans = {}, []
    for name, meta in header.items():
        dtype, shape, begin, end = _parse_entry(path, name, meta)
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: tensor '{name}' spans {end - begin} bytes but its shape {list(shape)} of "
                             f"{meta['dtype']} needs {math.prod(shape) * dtype.itemsize}")
        entries[name] = _Entry(path, dtype, shape, data_start + begin)
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            kind = "overlaps the previous tensor" if begin < position else "leaves a gap before it"
            raise ValueError(f"{path} is corrupt: tensor '{name}' at bytes {begin}..{end} {kind}")
        position = end
    if data_start + position != file_size:
        raise ValueError(f"{path} is truncated or corrupt: its header describes {data_start + position} bytes, "
                         f"the file has {file_size}")
    return entries


def _parse_entry(path: Path, name: str, meta) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: tensor '{name}' has a corrupt header entry")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in _DTYPES:
        raise ValueError(f"{path}: tensor '{name}' has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"{path}: tensor '{name}' has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"{path}: tensor '{name}' has invalid data_offsets {offsets!r}")
    return _DTYPES[dtype], tuple(shape), offsets[0], offsets[1]


def _read_weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> file map, every file a plain name inside the model folder."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise ValueError(f"{index} is not a JSON object with a 'weight_map'") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
    for file in set(weight_map.values()):
        if Path(file).is_absolute() or ".." in Path(file).parts or "\\" in file or not file.strip():
            raise ValueError(f"{index} names the file '{file}', outside the model folder: only files in "
                             f"{index.parent} are read")
    return weight_map


def _check_weight_map(index: Path, weight_map: dict[str, str], entries: dict[str, _Entry]) -> None:
    for name, file in weight_map.items():
        entry = entries.get(name)
        if entry is None or entry.path != index.parent / file:
            raise ValueError(f"{index} places tensor '{name}' in {file}, which does not hold it")
    stray = sorted(set(entries) - set(weight_map))
    if stray:
        raise ValueError(f"{index} does not list tensor '{stray[0]}', which {entries[stray[0]].path} holds")


class SafetensorsWriter:
    """Writes tensors into shards of at most `max_shard_bytes`, then an index if there is more than one."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2 * 1024**3):
        self.dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[dict[str, int]] = []  # per shard: name -> bytes

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size

    def _flush(self) -> None:
        index = len(self._files)
        path = self.dir / f"part-{index}.tmp"
        try:
            save_file(self._pending, path, metadata={"format": "pt"})
        except SafetensorError as err:  # its I/O errors (disk full, quota) as the OSError they are, naming the file
            code = re.search(r"os error (\d+)", str(err))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
        # safetensors' writer can report success on a short write (seen writing to a full device).
        try:
            _read_entries(path)
        except ValueError:
            raise OSError(errno.EIO, "the file came out incomplete (is the disk full?)", str(path)) from None
        self._files.append({name: t.numel() * t.element_size() for name, t in self._pending.items()})
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._files:
            self._flush()
        count = len(self._files)
        if count == 1:
            (self.dir / "part-0.tmp").rename(self.dir / SINGLE_NAME)
            return
        weight_map, total = {}, 0
        for i, names in enumerate(self._files):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.dir / f"part-{i}.tmp").rename(self.dir / final)
            weight_map.update({name: final for name in names})
            total += sum(names.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2))
