"""Step checkpoints mirrored to S3-compatible object storage (AWS S3, MinIO, ...), and resume from the mirror.

    s3://BUCKET/PREFIX/step_000012/actor/...          every file of the checkpoint, uploaded first
    s3://BUCKET/PREFIX/step_000012/mirror_complete.json   written last: each file's path, size and sha256

A mirrored checkpoint exists only once its marker does, and a reader takes it only if every object the marker
lists has the listed size and (on download) sha256: an upload cut short by a dead server, a kill or a deleted
object is never taken for a checkpoint. Pruning deletes the marker first, then the objects.

Uploads run in one background thread of rank 0 from a hard-linked snapshot of the published checkpoint in
RUN/.mirror_pending (so `keep_last` pruning of the run folder cannot pull files from under an upload, and a
killed run's pending uploads are taken up by the next start); failures are retried with backoff while
training goes on. Endpoint and credentials come from boto3's standard sources
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ~/.aws, instance roles). Everything read from the
bucket is hostile: paths are confined to the checkpoint folder, sizes bounded by the marker and free disk.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from verl_mega.config.errors import UserError
from verl_mega.files.atomic import atomic_output_dir
from verl_mega.files.digest import check_relative_path, file_entries

from .folder import RunFolder, checkpoint_step, step_name

MARKER_NAME = "mirror_complete.json"
MARKER_FORMAT = 1
_MAX_MARKER_BYTES = 16 * 2**20
_MAX_FILES = 100_000
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 2**20
_FIRST_RETRY_S, _MAX_RETRY_S = 1.0, 30.0


class MirrorError(Exception):
    """The mirror cannot be reached or holds no usable checkpoint where one was expected."""


@dataclass(frozen=True)
class MirrorLocation:
    bucket: str
    prefix: str  # no leading or trailing "/"; may be empty

    def key(self, *parts: str) -> str:
        return "/".join(part for part in (self.prefix, *parts) if part)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_mirror_url(url: str) -> MirrorLocation:
    """`s3://bucket/prefix` -> MirrorLocation; ValueError saying what is wrong."""
    if not url.startswith("s3://"):
        raise ValueError(f"'{url}' must start with s3:// (s3://bucket/prefix)")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not _BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ValueError(f"'{url}': '{bucket}' is not an S3 bucket name (3-63 of a-z, 0-9, '.', '-')")
    prefix = prefix.strip("/")
    parts = prefix.split("/") if prefix else []
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"'{url}': the prefix may not hold empty, '.' or '..' parts")
    return MirrorLocation(bucket, prefix)


def require_boto3() -> None:
    """ImportError saying how to install boto3 where it is missing."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        raise ImportError("mirroring needs boto3: pip install 'verl_mega[mirror]'") from None


def s3_client():
    """A client from boto3's standard configuration; our own loop retries, so botocore tries each call once."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(connect_timeout=10, read_timeout=60,
                                            retries={"max_attempts": 1, "mode": "standard"}))


# --- writing ---------------------------------------------------------------------------------------------

def upload_checkpoint(client, location: MirrorLocation, ckpt: Path) -> None:
    """Upload every file of the checkpoint folder `ckpt`, check the objects' sizes, then write the marker. A
    marker from an earlier upload of the same step goes first: it must never vouch for objects being replaced."""
    step = ckpt.name
    entries = file_entries(ckpt)
    client.delete_object(Bucket=location.bucket, Key=location.key(step, MARKER_NAME))
    for entry in entries:
        client.upload_file(str(ckpt / entry["path"]), location.bucket, location.key(step, entry["path"]))
    for entry in entries:
        size = client.head_object(Bucket=location.bucket, Key=location.key(step, entry["path"]))["ContentLength"]
        if size != entry["size"]:
            raise MirrorError(f"{location.key(step, entry['path'])} holds {size} bytes after upload, not "
                              f"{entry['size']}")
    marker = {"format": MARKER_FORMAT, "step": checkpoint_step(ckpt), "files": entries}
    client.put_object(Bucket=location.bucket, Key=location.key(step, MARKER_NAME),
                      Body=json.dumps(marker, indent=1).encode())


def prune(client, location: MirrorLocation, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; older step folders (complete or not) go, marker first."""
    steps = list_steps(client, location)
    complete = [step for step in steps if _marker_exists(client, location, step)]
    if keep_last <= 0 or len(complete) <= keep_last:
        return
    oldest_kept = complete[-keep_last]
    for step in steps:
        if step < oldest_kept:
            name = step_name(step)
            client.delete_object(Bucket=location.bucket, Key=location.key(name, MARKER_NAME))
            keys = [obj["Key"] for obj in _list_objects(client, location.bucket, location.key(name) + "/")]
            for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
                client.delete_objects(Bucket=location.bucket, Delete={
                    "Objects": [{"Key": key} for key in keys[start:start + 1000]], "Quiet": True})


class CheckpointMirror:
    """Rank 0's background uploader: `submit` returns at once; `finish` waits a bounded time at the run's end."""

    def __init__(self, location: MirrorLocation, run_dir: Path, keep_last: int):
        self.location, self.keep_last = location, keep_last
        self.pending_root = RunFolder(run_dir).mirror_pending
        self._queue: queue.Queue[Path | None] = queue.Queue()
        if self.pending_root.is_dir():  # a killed run's snapshots: whole ones are uploaded, half-made ones dropped
            for path in sorted(self.pending_root.iterdir(), key=lambda p: checkpoint_step(p) or -1):
                if checkpoint_step(path) is None:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    self._queue.put(path)
        self._given_up = threading.Event()
        self._thread = threading.Thread(target=self._work, name="checkpoint-mirror", daemon=True)
        self._thread.start()

    def submit(self, ckpt: Path) -> None:
        """Queue the published checkpoint folder `ckpt` for upload (a hard-linked snapshot: instant, no copy)."""
        snapshot = self.pending_root / ckpt.name
        with atomic_output_dir(snapshot, overwrite=True) as tmp:
            shutil.copytree(ckpt, tmp, copy_function=_link_or_copy, dirs_exist_ok=True)
        self._queue.put(snapshot)

    def finish(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for queued uploads; False (with a warning on stderr) if some did not finish:
        those are given up at their next retry."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._given_up.set()
            left = sorted(p.name for p in self.pending_root.glob("step_*"))
            _warn(f"{', '.join(left)} not mirrored to {self.location} within {timeout_s:.0f} s (trainer."
                  f"checkpoint_mirror_wait_s); the next start of this run uploads them from {self.pending_root}")
            return False
        return True

    def _work(self) -> None:
        client = None
        while (snapshot := self._queue.get()) is not None:
            delay, uploaded = _FIRST_RETRY_S, False
            while True:
                try:
                    client = client or s3_client()
                    if not uploaded:
                        upload_checkpoint(client, self.location, snapshot)
                        uploaded = True
                    prune(client, self.location, self.keep_last)
                    break
                except Exception as err:  # botocore's errors share no base class with network failures
                    _warn(f"mirroring {snapshot.name} to {self.location} failed ({type(err).__name__}: "
                          f"{str(err)[:300]}); retrying in {delay:.0f} s")
                    if self._given_up.wait(delay):
                        return
                    delay = min(2 * delay, _MAX_RETRY_S)
            shutil.rmtree(snapshot, ignore_errors=True)
            print(f"mirrored {snapshot.name} to {self.location}", file=sys.stderr, flush=True)


# --- reading ---------------------------------------------------------------------------------------------

def list_steps(client, location: MirrorLocation) -> list[int]:
    """Step numbers that have a folder under the prefix (complete or not), oldest first."""
    root = location.key() + "/" if location.prefix else ""
    steps = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=root,
                                                                  Delimiter="/"):
        for common in page.get("CommonPrefixes", []):
            step = checkpoint_step(PurePosixPath(common["Prefix"][len(root):]))
            if step is not None:
                steps.append(step)
    return sorted(steps)


def read_marker(client, location: MirrorLocation, step: int) -> list[dict]:
    """The marker's file entries, checked: every path confined to the folder, every object of the listed size.
    MirrorError says why a checkpoint is not usable."""
    key = location.key(step_name(step), MARKER_NAME)
    try:
        raw = client.get_object(Bucket=location.bucket, Key=key)["Body"].read(_MAX_MARKER_BYTES + 1)
    except client.exceptions.NoSuchKey:
        raise MirrorError(f"{key} does not exist (the upload never completed)") from None
    if len(raw) > _MAX_MARKER_BYTES:
        raise MirrorError(f"{key} is larger than {_MAX_MARKER_BYTES} bytes")
    try:
        marker = json.loads(raw)
        entries = _checked_entries(marker, step)
    except ValueError as err:
        raise MirrorError(f"{key} is not a valid marker ({err})") from None
    for entry in entries:
        object_key = location.key(step_name(step), entry["path"])
        try:
            size = client.head_object(Bucket=location.bucket, Key=object_key)["ContentLength"]
        except client.exceptions.ClientError as err:
            raise MirrorError(f"{object_key} listed in the marker is unreadable ({err})") from None
        if size != entry["size"]:
            raise MirrorError(f"{object_key} holds {size} bytes, the marker lists {entry['size']}")
    return entries


def fetch_newer(client, location: MirrorLocation, run_dir: Path, newer_than: int) -> Path | None:
    """Download the newest mirrored checkpoint above step `newer_than` that checks out (marker, sizes, sha256)
    into the run's checkpoints; incomplete or tampered ones are skipped with a warning. None if there is none."""
    for step in reversed(list_steps(client, location)):
        if step <= newer_than:
            break
        try:
            entries = read_marker(client, location, step)
            return download_checkpoint(client, location, step, entries, RunFolder(run_dir).step(step))
        except MirrorError as err:
            _warn(f"mirror checkpoint {step_name(step)} skipped: {err}")
    return None


def connect(location: MirrorLocation, attempts: int = 3):
    """A client that has listed the mirror once; UserError naming trainer.checkpoint_mirror if it cannot."""
    delay = _FIRST_RETRY_S
    for attempt in range(attempts):
        client = s3_client()
        try:
            list_steps(client, location)
            return client
        except Exception as err:  # network, credentials, missing bucket: botocore's errors share no base
            if attempt == attempts - 1:
                raise UserError(f"trainer.checkpoint_mirror: cannot list {location} ({type(err).__name__}: "
                                f"{str(err)[:300]}); check the bucket, AWS_ENDPOINT_URL and the credentials") from None
            time.sleep(delay)
            delay *= 2


def download_checkpoint(client, location: MirrorLocation, step: int, entries: list[dict], out: Path) -> Path:
    """Download into a temp folder beside `out`, verify each file's size and sha256, then rename into place."""
    total = sum(entry["size"] for entry in entries)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if total > free:
        raise MirrorError(f"{location.key(step_name(step))} needs {total} bytes; {out.parent} has {free} free")
    with atomic_output_dir(out, overwrite=True) as tmp:
        for entry in entries:
            target = tmp / entry["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            _download_file(client, location, location.key(step_name(step), entry["path"]), target, entry)
    return out


def _download_file(client, location: MirrorLocation, key: str, target: Path, entry: dict) -> None:
    body = client.get_object(Bucket=location.bucket, Key=key)["Body"]
    # Hashed as the bytes arrive (not files/digest.py's read of a finished file): one pass over a large download.
    digest, written = hashlib.sha256(), 0
    with target.open("wb") as handle:
        while chunk := body.read(min(_CHUNK, entry["size"] - written + 1)):
            written += len(chunk)
            if written > entry["size"]:
                raise MirrorError(f"{key} is longer than the {entry['size']} bytes its marker lists")
            digest.update(chunk)
            handle.write(chunk)
    if written != entry["size"] or digest.hexdigest() != entry["sha256"]:
        raise MirrorError(f"{key} does not match its marker (size {written} vs {entry['size']}, or sha256 differs)")


def _checked_entries(marker, step: int) -> list[dict]:
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT or marker.get("step") != step:
        raise ValueError(f"expected format {MARKER_FORMAT} and step {step}")
    entries = marker.get("files")
    if not isinstance(entries, list) or not 0 < len(entries) <= _MAX_FILES:
        raise ValueError(f"'files' must list 1..{_MAX_FILES} files")
    seen = set()
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"path", "size", "sha256"}:
            raise ValueError("each file needs exactly path, size and sha256")
        path, size, sha = entry["path"], entry["size"], entry["sha256"]
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
            raise ValueError(f"size {size!r} is not a byte count")
        if not (isinstance(sha, str) and _SHA256.match(sha)):
            raise ValueError(f"sha256 {sha!r} is not a hex digest")
        check_relative_path(path)
        if path in seen or path == MARKER_NAME:
            raise ValueError(f"'{path}' is listed twice or names the marker")
        seen.add(path)
    paths = sorted(seen)
    for parent, child in zip(paths, paths[1:]):  # a file and a folder of the same name cannot both exist
        if child.startswith(parent + "/"):
            raise ValueError(f"'{parent}' is both a file and a folder")
    return entries


def _link_or_copy(source: str, target: str) -> None:
    """Checkpoint files are never rewritten in place, so a hard link is a snapshot; a copy where links fail."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _marker_exists(client, location: MirrorLocation, step: int) -> bool:
    try:
        client.head_object(Bucket=location.bucket, Key=location.key(step_name(step), MARKER_NAME))
        return True
    except client.exceptions.ClientError:
        return False


def _list_objects(client, bucket: str, prefix: str):
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        yield from page.get("Contents", [])


def _warn(message: str) -> None:
    print(f"WARNING: checkpoint mirror: {message}", file=sys.stderr, flush=True)
