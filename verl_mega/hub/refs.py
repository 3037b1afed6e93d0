"""What names a Hub repository in a setting: `org/name[@revision]` for a model, `hf://datasets/org/name[@rev]/path`
for data files, and how either is told from a local path.

A local path wins: a value naming an existing file or folder is that path, whatever it looks like; so is one
starting with `/`, `.` or `~`. Only the rest is read as a Hub id, and only when it has the id's shape (exactly one
`/` between two names of letters, digits, `-`, `_` and `.`). `models/qwen` typed for a folder that does not exist
is therefore looked up on the Hub, and its error says that no such local folder exists either.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REVISION = "main"
DATASET_SCHEME = "hf://datasets/"
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_MODEL_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[A-Za-z0-9_.\-/]+))?")
_DATASET_URL = re.compile(rf"hf://datasets/(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[A-Za-z0-9_.\-]+))?"
                          r"(?:/(?P<path>.*))?")


@dataclass(frozen=True)
class HubRef:
    """A repository at a revision (a branch, tag or commit); `path`: the files asked for in a dataset."""
    repo_id: str
    revision: str = DEFAULT_REVISION
    repo_type: str = "model"
    path: str = ""

    def __str__(self) -> str:
        at = "" if self.revision == DEFAULT_REVISION else f"@{self.revision}"
        if self.repo_type == "dataset":
            return f"{DATASET_SCHEME}{self.repo_id}{at}" + (f"/{self.path}" if self.path else "")
        return f"{self.repo_id}{at}"


def model_ref(value: str | os.PathLike) -> HubRef | None:
    """The Hub model `value` names, or None when it is a local path (see the module's rule)."""
    text = os.fspath(value)
    if not text or text.startswith(("/", ".", "~")) or Path(text).exists():
        return None
    match = _MODEL_ID.fullmatch(text)
    if match is None:
        return None
    return HubRef(match["repo"], match["revision"] or DEFAULT_REVISION)


def is_repo_id(text: str) -> bool:
    """`text` is a bare repo id `org/name` (no revision), whatever the local folders are."""
    match = _MODEL_ID.fullmatch(text)
    return match is not None and match["revision"] is None


def dataset_ref(value: str | os.PathLike) -> HubRef | None:
    """The Hub dataset files `value` names (`hf://datasets/org/name[@rev][/path]`), or None for anything else.
    Raises ValueError for an `hf://datasets/` value of another shape."""
    text = os.fspath(value)
    if not text.startswith(DATASET_SCHEME):
        return None
    match = _DATASET_URL.fullmatch(text)
    if match is None:
        raise ValueError(f"{text} is not hf://datasets/ORG/NAME[@REVISION][/PATH]")
    return HubRef(match["repo"], match["revision"] or DEFAULT_REVISION, "dataset", (match["path"] or "").strip("/"))
