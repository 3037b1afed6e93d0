"""Streaming safetensors IO: read one tensor (or one TP slice of it) at a time; write bounded shards."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class SafetensorsReader:
    """Lazy access to an HF checkpoint folder (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SINGLE_NAME).is_file():
            weight_map = {name: SINGLE_NAME for name in _header(self.dir / SINGLE_NAME)}
        else:
            raise FileNotFoundError(f"{self.dir} holds neither {SINGLE_NAME} nor {INDEX_NAME}")
        for file in sorted(set(weight_map.values())):
            path = self.dir / file
            if not path.is_file():
                raise FileNotFoundError(f"shard {path} named in {INDEX_NAME} is missing")
            _check_complete(path)
        self._file_of = weight_map
        self._handles = {}

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _slice(self, name: str):
        file = self._file_of.get(name)
        if file is None:
            raise KeyError(f"tensor '{name}' is not in the checkpoint at {self.dir}")
        if file not in self._handles:
            self._handles[file] = safe_open(self.dir / file, framework="pt")
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        return self._slice(name)[:]

    def read_part(self, name: str, dim: int, part: int, parts: int, padded_rows: int | None = None) -> torch.Tensor:
        """Part `part` of `parts` equal parts along `dim`, reading only those bytes.

        With `padded_rows`, dim 0 is first zero-padded to that length (megatron's padded vocabulary).
        """
        view = self._slice(name)
        shape = list(view.get_shape())
        total = padded_rows if padded_rows is not None else shape[dim]
        if total % parts:
            raise ValueError(f"'{name}' dim {dim} of size {total} does not split into {parts} equal parts")
        length = total // parts
        start = part * length
        present = max(0, min(start + length, shape[dim]) - start)

        def rows(count: int):
            index = [slice(None)] * len(shape)
            index[dim] = slice(start, start + count)
            return view[tuple(index)]

        if present == length:
            return rows(length)
        padded = torch.zeros([length if d == dim else s for d, s in enumerate(shape)], dtype=_dtype(view))
        if present:
            padded.narrow(dim, 0, present).copy_(rows(present))
        return padded


def _dtype(view) -> torch.dtype:
    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
    return names[view.get_dtype()]


def _header(path: Path) -> dict:
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
    return header


def _check_complete(path: Path) -> None:
    header = _header(path)
    (length,) = struct.unpack("<Q", path.open("rb").read(8))
    data_end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if path.stat().st_size < 8 + length + data_end:
        raise ValueError(
            f"{path} is truncated: its header describes {8 + length + data_end} bytes, the file has {path.stat().st_size}"
        )


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
