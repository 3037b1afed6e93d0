"""Streaming safetensors IO: read one tensor (or one TP slice of it) at a time; write bounded shards."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


_COLUMN_READ_CHUNK_BYTES = 4 * 1024**2


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
        index = self.dir / INDEX_NAME
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.dir / SINGLE_NAME).is_file():
            files = [SINGLE_NAME]
        else:
            raise FileNotFoundError(f"{self.dir} holds neither {SINGLE_NAME} nor {INDEX_NAME}")
        self._entries: dict[str, _Entry] = {}
        self._fds: dict[Path, int] = {}
        for file in files:
            path = self.dir / file
            if not path.is_file():
                raise FileNotFoundError(f"shard {path} named in {INDEX_NAME} is missing")
            self._entries.update(_read_entries(path))

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(f"tensor '{name}' is not in the checkpoint at {self.dir}")
        return entry

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

    def _pread_into(self, entry: _Entry, offset: int, buffer) -> None:
        fd = self._fds.get(entry.path)
        if fd is None:
            fd = self._fds[entry.path] = os.open(entry.path, os.O_RDONLY)
        if os.preadv(fd, [buffer], offset) != buffer.nbytes:
            raise ValueError(f"{entry.path} ended early while reading a tensor: the file is truncated")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        self.close()


def _bytes_of(tensor: torch.Tensor):
    return tensor.view(-1).view(torch.uint8).numpy()


def _read_entries(path: Path) -> dict[str, _Entry]:
    """Parse a safetensors header, checking that the file holds all the bytes it describes."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is truncated or not a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path} has a corrupt safetensors header") from None
    header.pop("__metadata__", None)
    data_start = 8 + length
    data_end = max((meta["data_offsets"][1] for meta in header.values()), default=0)
    if path.stat().st_size < data_start + data_end:
        raise ValueError(
            f"{path} is truncated: its header describes {data_start + data_end} bytes, the file has {path.stat().st_size}"
        )
    entries = {}
    for name, meta in header.items():
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor '{name}' has unsupported dtype {meta['dtype']}")
        entries[name] = _Entry(path, _DTYPES[meta["dtype"]], tuple(meta["shape"]), data_start + meta["data_offsets"][0])
    return entries


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
        save_file(self._pending, self.dir / f"part-{index}.tmp", metadata={"format": "pt"})
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
