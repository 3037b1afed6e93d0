"""The sha256 of a file's bytes, read in chunks: a file of any size costs its read time and little memory; of a
folder, as its files' names and bytes; and a folder's files listed with their sizes and digests (a checkpoint's
record of its files, the mirror's marker)."""
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


def folder_files(root: str | os.PathLike) -> list[Path]:
    """Every file under `root`, sorted by path."""
    return sorted(path for path in Path(root).rglob("*") if path.is_file())


def file_entry(root: str | os.PathLike, path: Path) -> dict:
    """The file `path` under `root`: its path relative to `root` (posix), size and sha256."""
    return {"path": path.relative_to(root).as_posix(), "size": path.stat().st_size, "sha256": file_sha256(path)}


def file_entries(root: str | os.PathLike) -> list[dict]:
    """`file_entry` of every file under `root`, sorted by path."""
    return [file_entry(root, path) for path in folder_files(root)]


def check_relative_path(path) -> None:
    """Raise ValueError unless `path` stays inside its folder on every OS: relative, no '..', '.', empty parts."""
    if not isinstance(path, str) or not path or len(path) > 1024 or "\\" in path or "\0" in path:
        raise ValueError(f"path {path!r} is not a plain relative path")
    if path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError(f"path {path!r} leaves the checkpoint folder")
