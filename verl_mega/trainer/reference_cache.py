"""The frozen reference's summed log-probs of every train and validation row, computed once and kept in the run
folder (`algorithm.cache_reference_logprobs`), so that the preference job needs no reference model per step.

The file is safetensors (no pickle): tensors `train` and `val` (float32, one value per batch row: a pair's
chosen then rejected) and metadata `key`, the fingerprint of what the values depend on (the data files, the
examples as tokenized, which covers the tokenizer and the truncation settings, the reference's weights and
dtype), and `checksum`, the sha256 of the values. A cache of other inputs (data, model or settings changed) is
stale and recomputed; one whose values do not match their checksum, or that cannot be read, is refused.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from verl_mega.config.errors import UserError
from verl_mega.files.atomic import atomic_write_bytes
from verl_mega.files.digest import update_with_path

SPLITS = ("train", "val")


def cache_key(data_files: list[str], examples: dict[str, list], reference_ckpt: Path, dtype: str) -> str:
    """sha256 of the inputs of the cached values; `examples`: split -> the examples as tokenized."""
    digest = hashlib.sha256()
    for path in data_files:  # a file, or a datasets folder
        update_with_path(digest, path)
    for split in SPLITS:
        digest.update(json.dumps([[e.prompt, e.completions] for e in examples[split]]).encode())
    update_with_path(digest, reference_ckpt)
    digest.update(dtype.encode())
    return digest.hexdigest()


def values_checksum(values: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for split in SPLITS:
        digest.update(values[split].contiguous().numpy().tobytes())
    return digest.hexdigest()


def write_cache(path: Path, key: str, values: dict[str, torch.Tensor]) -> None:
    values = {split: values[split].float().cpu().contiguous() for split in SPLITS}
    atomic_write_bytes(path, save(values, metadata={"key": key, "checksum": values_checksum(values)}))


def read_cache(path: Path, key: str, rows: dict[str, int]) -> dict[str, torch.Tensor] | None:
    """The cached values if `path` holds them for `key` (`rows`: split -> expected count); None when there is no
    cache or it is stale (other inputs). Raises UserError for a file that is unreadable or altered."""
    if not path.is_file():
        return None
    refuse = f"{path}: not a valid reference log-prob cache ({{}}); delete it to have it recomputed"
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("key") != key:
                return None
            if sorted(handle.keys()) != sorted(SPLITS):
                raise UserError(refuse.format(f"tensors {sorted(handle.keys())}, expected {list(SPLITS)}"))
            values = {split: handle.get_tensor(split) for split in SPLITS}
    except UserError:
        raise
    except Exception as err:  # safetensors' own errors have no common base beyond Exception
        raise UserError(refuse.format(f"unreadable: {err}")) from None
    for split, tensor in values.items():
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != (rows[split],):
            raise UserError(refuse.format(f"{split} is {tensor.dtype} {tuple(tensor.shape)}, expected float32 "
                                          f"({rows[split]},)"))
    if metadata.get("checksum") != values_checksum(values):
        raise UserError(refuse.format("its values do not match their checksum"))
    return values

