"""The sha256 of a file's bytes, read in chunks: a file of any size costs its read time and little memory; and of
a folder, as its files' names and bytes."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

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


def update_with_path(digest: "hashlib._Hash", path: str | os.PathLike) -> None:
    """Feed the sha256 of a file, or of each file of a folder (after its relative name, in sorted order), into
    `digest`: a data input given as a file or as a folder (an HF `datasets` save_to_disk) has one checksum."""
    path = Path(path)
    if not path.is_dir():
        digest.update(bytes.fromhex(file_sha256(path)))
        return
    for file in sorted(item for item in path.rglob("*") if item.is_file()):
        digest.update(str(file.relative_to(path)).encode())
        digest.update(bytes.fromhex(file_sha256(file)))
