"""The sha256 of a file's bytes, read in chunks: a file of any size costs its read time and little memory."""
from __future__ import annotations

import hashlib
import os

_CHUNK_BYTES = 16 << 20


def update_with_file(digest: "hashlib._Hash", path: str | os.PathLike) -> None:
    """Feed the bytes of `path` into `digest` (for a checksum over several files)."""
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)


def file_sha256(path: str | os.PathLike) -> str:
    """The hex sha256 of the bytes of `path`."""
    digest = hashlib.sha256()
    update_with_file(digest, path)
    return digest.hexdigest()
