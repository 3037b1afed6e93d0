"""A Hub model or dataset as local files, through huggingface_hub's cache (a second run downloads nothing).

The environment is read at each call, as huggingface_hub documents it: `HF_ENDPOINT` (a mirror), `HF_TOKEN` (or
the token `hf auth login` stored), `HF_HUB_OFFLINE` (the cache alone) and `HF_HOME` / `HF_HUB_CACHE` (where the
cache is). A model brings its config, tokenizer and safetensors weights; `.bin` / `.pt` weights are pickles, which
the toolkit never loads (it reads safetensors only), so a repo with no safetensors is refused. No code (`*.py`) is
downloaded.

On one node, one process downloads a repo and the others wait on a lock file in the cache; when it fails, the
waiting processes raise its message instead of trying again. A download killed half-way leaves a
`*.incomplete` file in the cache's blobs; the next resolve of that repo removes it (under the lock) and fetches
what is missing, keeping the files already complete. Every failure is one line naming the id (HubError).
"""
from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx2
from huggingface_hub import HfApi, get_cached_repo_tree, get_token, snapshot_download
from huggingface_hub.errors import (CachedRepoTreeNotFoundError, GatedRepoError, HfHubHTTPError,
                                    LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

from verl_mega.config.errors import UserError

from .refs import DEFAULT_REVISION, HubRef

DEFAULT_ENDPOINT = "https://huggingface.co"
# What a model folder needs besides its weights: config, generation config, tokenizer files, chat template.
MODEL_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.safetensors"]
PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt")
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(UserError):
    """A Hub input that cannot be had; the message names the id and what to do."""


@dataclass(frozen=True)
class Resolved:
    ref: HubRef
    commit: str
    path: Path  # the snapshot folder (for a dataset: the files are `files` under it)
    files: tuple[str, ...] = ()


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def storage_folder(ref: HubRef) -> Path:
    """huggingface_hub's folder of a repo in the cache (`models--org--name`)."""
    return cache_dir() / "--".join([f"{ref.repo_type}s", *ref.repo_id.split("/")])


def resolve_model(ref: HubRef, *, weights: bool = True) -> Resolved:
    """The snapshot folder of a Hub model: config, tokenizer and safetensors weights (`weights=False`: its
    config.json alone, what the planners read)."""
    return _resolve(ref, _model_files if weights else _config_file)


def resolve_dataset(ref: HubRef) -> Resolved:
    """The data files `ref.path` names in a Hub dataset: a file, a folder (its parquet / jsonl files), a glob, or a
    split by name in the Hub's parquet layout (`data/train-00000-of-00002.parquet`, `default/train/0000.parquet`,
    `train.parquet`)."""
    return _resolve(ref, _data_files)


def _model_files(ref: HubRef, files: list[str]) -> list[str]:
    if any(file.endswith(".safetensors") for file in files):
        return [file for file in files if any(fnmatch.fnmatch(file, pattern) for pattern in MODEL_PATTERNS)]
    pickles = sorted(file for file in files if file.endswith(PICKLE_WEIGHTS))
    if pickles:
        raise HubError(f"Hub model {ref}: its weights are pickles ({', '.join(pickles[:3])}), which are never loaded "
                       "(they can run code); use a revision with safetensors weights")
    raise HubError(f"Hub model {ref}: has no weights (no *.safetensors file)")


def _config_file(ref: HubRef, files: list[str]) -> list[str]:
    if "config.json" not in files:
        raise HubError(f"Hub model {ref}: has no config.json (not a transformers model)")
    return ["config.json"]


def _data_files(ref: HubRef, files: list[str]) -> list[str]:
    path = ref.path
    if not path:
        raise HubError(f"Hub dataset {ref}: name a file, folder or split after the repo (hf://datasets/ORG/NAME/PATH)")
    data = sorted(file for file in files if file.endswith(DATA_SUFFIXES) and not file.startswith("."))
    split = re.compile(rf"(^|.*/){re.escape(path)}(-\d+-of-\d+|/[^/]+|)\.(parquet|jsonl)")
    for chosen in ([path] if path in files else [],
                   [file for file in data if file.startswith(path + "/")],
                   [file for file in data if fnmatch.fnmatch(file, path)],
                   [file for file in data if split.fullmatch(file)]):
        if chosen:
            return chosen
    raise HubError(f"Hub dataset {ref}: no file, folder or split named {path!r} (its data files: "
                   f"{', '.join(data[:5]) or 'none'})")


def _resolve(ref: HubRef, choose: Callable[[HubRef, list[str]], list[str]]) -> Resolved:
    with _node_lock(ref):
        _remove_incomplete(ref)
        try:
            return _fetch(ref, choose)
        finally:
            _remove_incomplete(ref)


def _fetch(ref: HubRef, choose) -> Resolved:
    kind = f"Hub {ref.repo_type}"
    files = None if offline() else _listing(ref)
    revision, cache_only = ref.revision, files is None
    if cache_only:  # offline, or the endpoint is unreachable
        revision = _cached_commit(ref)
        snapshot = storage_folder(ref) / "snapshots" / revision if revision else None
        if snapshot is None or not snapshot.is_dir():
            raise HubError(f"{kind} {ref}: {_why_cache_only()} and the cache ({cache_dir()}) holds no copy of it; "
                           "download it once online" + _not_local(ref))
        files = _cached_listing(ref, revision, snapshot)
    chosen = choose(ref, files)
    try:
        folder = snapshot_download(ref.repo_id, repo_type=ref.repo_type, revision=revision, allow_patterns=chosen,
                                   cache_dir=cache_dir(), endpoint=endpoint(), local_files_only=cache_only)
    except LocalEntryNotFoundError:  # an incomplete snapshot with nothing to complete it from
        raise HubError(f"{kind} {ref}: {_why_cache_only()} and the cache holds an incomplete copy (a download cut "
                       "short); run again online to complete it") from None
    except (httpx2.TransportError, HfHubHTTPError) as err:
        raise HubError(f"{kind} {ref}: the download stopped ({first_line(err)}); run again to complete it "
                       "(the files already downloaded are kept)") from None
    # The snapshot folder is named by its commit (a branch may have moved since the listing).
    return Resolved(ref, Path(folder).name, Path(folder), tuple(chosen))


def _listing(ref: HubRef) -> list[str] | None:
    """The files of `ref` on the Hub; None when the endpoint cannot be reached."""
    kind = f"Hub {ref.repo_type}"
    try:
        info = HfApi(endpoint=endpoint()).repo_info(ref.repo_id, repo_type=ref.repo_type, revision=ref.revision)
    except httpx2.TransportError:
        return None
    except GatedRepoError:
        raise HubError(f"{kind} {ref} is gated: accept its conditions on the Hub with the account whose token "
                       "HF_TOKEN holds") from None
    except RepositoryNotFoundError:
        hint = ("or HF_TOKEN's account cannot read it" if get_token() else
                "or it is private: set HF_TOKEN to a token that can read it")
        raise HubError(f"{kind} {ref} is not on {endpoint()}, {hint}" + _not_local(ref)) from None
    except RevisionNotFoundError:
        raise HubError(f"{kind} {ref}: no revision {ref.revision!r} (a branch, tag or commit of the repo)") from None
    except HfHubHTTPError as err:
        raise HubError(f"{kind} {ref}: {endpoint()} answered {first_line(err)}") from None
    return [sibling.rfilename for sibling in info.siblings or []]


def _cached_listing(ref: HubRef, commit: str, snapshot: Path) -> list[str]:
    """The repo's files at `commit` as the cache recorded them when it was listed online (so a copy cut short is
    known to be incomplete), else the files the snapshot holds."""
    try:
        return [file.path for file in get_cached_repo_tree(ref.repo_id, repo_type=ref.repo_type, revision=commit,
                                                          cache_dir=cache_dir())]
    except CachedRepoTreeNotFoundError:
        return sorted(str(path.relative_to(snapshot)) for path in snapshot.rglob("*") if path.is_file())


def _why_cache_only() -> str:
    return "HF_HUB_OFFLINE is set" if offline() else f"HF_ENDPOINT {endpoint()} cannot be reached"


def _cached_commit(ref: HubRef) -> str | None:
    if _COMMIT.fullmatch(ref.revision):
        return ref.revision
    ref_file = storage_folder(ref) / "refs" / ref.revision
    return ref_file.read_text().strip() if ref_file.is_file() else None


def _not_local(ref: HubRef) -> str:
    return f" (and no local folder {ref.repo_id} exists)" if ref.repo_type == "model" else ""


def first_line(err: BaseException) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


def _remove_incomplete(ref: HubRef) -> None:
    """Partial downloads of a process that was killed (its own are removed by huggingface_hub); called under the
    node lock, so no process of this node is writing them."""
    for partial in (storage_folder(ref) / "blobs").glob("*.incomplete"):
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def _node_lock(ref: HubRef) -> Iterator[None]:
    """Held while one process resolves `ref`; the others of the node (same cache) wait. A failure is left in a
    file beside the lock: a process that was waiting when it was written raises it instead of trying again."""
    locks = cache_dir() / ".locks" / "verl_mega"
    locks.mkdir(parents=True, exist_ok=True)
    name = storage_folder(ref).name + (f"@{ref.revision}".replace("/", "%") if ref.revision != DEFAULT_REVISION else "")
    lock_path, failure_path = locks / f"{name}.lock", locks / f"{name}.failed"
    waiting_since = time.time()
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            failure = json.loads(failure_path.read_text()) if failure_path.is_file() else None
            if failure and failure["at"] >= waiting_since:
                raise HubError(failure["message"])
            try:
                yield
            except HubError as err:
                failure_path.write_text(json.dumps({"message": str(err), "at": time.time()}))
                raise
            failure_path.unlink(missing_ok=True)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def hub_origin(path: str | os.PathLike) -> dict | None:
    """{"id", "type", "commit", "refs"} when `path` is a snapshot of huggingface_hub's cache (where a Hub id
    resolved to), and "path" (in the repo) when it lies below one; else None: what a run's provenance records of
    a Hub input."""
    parts = Path(path).parts
    if "snapshots" not in parts:
        return None
    at = len(parts) - 1 - parts[::-1].index("snapshots")
    if at == 0 or at + 1 >= len(parts) or not _COMMIT.fullmatch(parts[at + 1]):
        return None
    kind, _, repo = parts[at - 1].partition("--")
    if kind not in ("models", "datasets") or "--" not in repo:
        return None
    commit = parts[at + 1]
    refs_dir = Path(*parts[:at]) / "refs"
    refs = sorted(str(file.relative_to(refs_dir)) for file in refs_dir.rglob("*")
                  if file.is_file() and file.read_text().strip() == commit) if refs_dir.is_dir() else []
    origin = {"id": repo.replace("--", "/", 1), "type": kind[:-1], "commit": commit, "refs": refs}
    return {**origin, "path": "/".join(parts[at + 2:])} if len(parts) > at + 2 else origin
