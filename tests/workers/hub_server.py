"""A Hub-compatible server for the Hub tests (`python -m tests.workers.hub_server ROOT [--token T]
[--bytes-per-s N]`): a threaded stdlib HTTP server on a free localhost port, printed as its first stdout line;
`HF_ENDPOINT=http://127.0.0.1:PORT` points huggingface_hub at it.

The self-hosted mirror olah (0.5.4) serves local git repositories offline, read-only: it has no create, preupload
or commit routes and reports every repo public, so it cannot hold a pushed model nor a private one. This server
speaks exactly the endpoints huggingface_hub 2.4.0 calls for `snapshot_download`, `hf_hub_download`, `repo_info`,
`create_repo`, `create_branch`, `update_repo_settings` and `upload_folder` (TYPE: models | datasets; the file
routes carry no `models/` prefix):

    GET  /api/TYPE/ORG/NAME[/revision/REV]      repo info: id, sha (the commit), private, gated, siblings
    GET  /api/TYPE/ORG/NAME/tree/REV[/PATH]     the files (recursive=1: all of them) as RepoFile entries
    HEAD|GET /[datasets/]ORG/NAME/resolve/REV/PATH
                                                a file: X-Repo-Commit, ETag (its sha256), Content-Length;
                                                GET honours `Range: bytes=N-`
    POST /api/repos/create                      {name, organization, visibility, type}; 409 when it exists
    PUT  /api/TYPE/ORG/NAME/settings            {visibility, gated}
    POST /api/TYPE/ORG/NAME/branch/BRANCH       a branch at main's commit (or {startingPoint})
    POST /api/TYPE/ORG/NAME/preupload/REV       every file goes "regular" (inline in the commit)
    POST /api/TYPE/ORG/NAME/commit/REV          the NDJSON commit: header, file (base64), deletedFile
    POST /api/validate-yaml                     a README.md's metadata (always valid here)

Errors carry the Hub's X-Error-Code (RepoNotFound 401, RevisionNotFound 404, EntryNotFound 404, GatedRepo 403),
which huggingface_hub turns into its typed errors. A private repo answers only to `Authorization: Bearer T`
(writes always need it); a gated repo answers GatedRepo to everyone (nobody has accepted its terms).

Storage under ROOT/TYPE/ORG/NAME: meta.json (private, gated, refs: branch or tag -> commit), commits/SHA.json
(the commit's files: path -> blob sha256) and blobs/SHA256. ROOT/requests.log gets one line per file download
(`GET PATH RANGE`), for the tests that count what was fetched. `--bytes-per-s` slows file bodies, so a download can
be interrupted in the middle.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LOCK = threading.Lock()
TYPES = {"models": "model", "datasets": "dataset"}
_FILE_ROUTE = re.compile(r"^/(?:(datasets)/)?([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")
_API_ROUTE = re.compile(r"^/api/(models|datasets)/([^/]+)/([^/]+)(?:/(revision|tree|preupload|commit|branch|settings)"
                        r"(?:/([^/]+))?(?:/(.*))?)?$")
_CHUNK = 16 * 1024


class HubError(Exception):
    def __init__(self, status: int, code: str, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.commit = status, code, commit


class Repo:
    def __init__(self, folder: Path):
        self.folder = folder

    @property
    def meta(self) -> dict:
        return json.loads((self.folder / "meta.json").read_text())

    def save_meta(self, meta: dict) -> None:
        (self.folder / "meta.json").write_text(json.dumps(meta))

    def commit(self, revision: str) -> str:
        refs = self.meta["refs"]
        if revision in refs:
            return refs[revision]
        if re.fullmatch(r"[0-9a-f]{40}", revision) and (self.folder / "commits" / f"{revision}.json").is_file():
            return revision
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def files(self, commit: str) -> dict[str, str]:
        return json.loads((self.folder / "commits" / f"{commit}.json").read_text())["files"]

    def blob(self, sha256: str) -> Path:
        return self.folder / "blobs" / sha256

    def write_commit(self, parent: str | None, files: dict[str, str], summary: str) -> str:
        body = json.dumps({"parent": parent, "files": files, "summary": summary, "at": time.time()}, sort_keys=True)
        sha = hashlib.sha1(body.encode()).hexdigest()
        (self.folder / "commits").mkdir(exist_ok=True)
        (self.folder / "commits" / f"{sha}.json").write_text(body)
        return sha


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects; every answer has a Content-Length
    root: Path
    token: str | None
    bytes_per_s: int

    def log_message(self, *args):  # quiet: the tests read requests.log
        pass

    # --- plumbing
    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, value, status: int = 200) -> None:
        self._send(status, json.dumps(value).encode())

    def _authorized(self) -> bool:
        return self.token is not None and self.headers.get("Authorization") == f"Bearer {self.token}"

    def _repo(self, kind: str, org: str, name: str, write: bool = False) -> Repo:
        repo = Repo(self.root / kind / org / name)
        if not (repo.folder / "meta.json").is_file() or (repo.meta["private"] or write) and not self._authorized():
            raise HubError(401, "RepoNotFound", "Repository not found")
        if repo.meta["gated"] and not write:
            raise HubError(403, "GatedRepo", "Access to this model is restricted: you must accept its conditions")
        return repo

    def _dispatch(self, handler) -> None:
        try:
            handler()
        except HubError as err:
            headers = {"X-Error-Code": err.code, "X-Error-Message": str(err)}
            if err.commit:
                headers["X-Repo-Commit"] = err.commit
            self._send(err.status, json.dumps({"error": str(err)}).encode(), headers)

    def do_HEAD(self):
        self._dispatch(self._get)

    def do_GET(self):
        self._dispatch(self._get)

    def do_POST(self):
        self._dispatch(self._post)

    def do_PUT(self):
        self._dispatch(self._post)

    # --- reads
    def _get(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        if match := _FILE_ROUTE.match(path):
            return self._file(match.group(1) or "models", *match.groups()[1:])
        match = _API_ROUTE.match(path)
        if not match or match.group(4) not in (None, "revision", "tree"):
            raise HubError(404, "NotFound", f"no route {path}")
        kind, org, name, action, revision, sub = match.groups()
        repo = self._repo(kind, org, name)
        commit = repo.commit(revision or "main")
        files = repo.files(commit)
        if action == "tree":
            recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() in ("1", "true")
            return self._json(self._tree(repo, files, sub or "", recursive))
        meta = repo.meta
        self._json({"id": f"{org}/{name}", "sha": commit, "private": meta["private"], "gated": meta["gated"] or False,
                    "siblings": [{"rfilename": file} for file in sorted(files)]})

    @staticmethod
    def _tree(repo: Repo, files: dict[str, str], prefix: str, recursive: bool) -> list[dict]:
        prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        entries, folders = [], set()
        for file, sha in sorted(files.items()):
            if not file.startswith(prefix):
                continue
            rest = file[len(prefix):]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/")[0])
                continue
            entries.append({"type": "file", "path": file, "size": repo.blob(sha).stat().st_size, "oid": sha[:40]})
        return [{"type": "directory", "path": folder, "oid": "0" * 40} for folder in sorted(folders)] + entries

    def _file(self, kind: str, org: str, name: str, revision: str, file: str) -> None:
        repo = self._repo(kind, org, name)
        commit = repo.commit(revision)
        files = repo.files(commit)
        if file not in files:
            raise HubError(404, "EntryNotFound", f"{file} does not exist at {revision}", commit=commit)
        blob = repo.blob(files[file])
        size = blob.stat().st_size
        start = 0
        if match := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or ""):
            start = min(int(match.group(1)), size)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{files[file]}"', "Accept-Ranges": "bytes"}
        if self.command == "HEAD":
            return self._head(headers, size)
        with LOCK, (self.root / "requests.log").open("a") as log:
            log.write(f"GET {kind}/{org}/{name}/{file} {start}\n")
        self.send_response(206 if start else 200)
        for key, value in headers.items():
            self.send_header(key, value)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size - start))
        self.end_headers()
        with blob.open("rb") as source:
            source.seek(start)
            while chunk := source.read(_CHUNK):
                self.wfile.write(chunk)
                if self.bytes_per_s:
                    time.sleep(len(chunk) / self.bytes_per_s)

    def _head(self, headers: dict, size: int) -> None:
        self.send_response(200)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(size))
        self.end_headers()

    # --- writes
    def _post(self) -> None:
        body = self._body()
        path = unquote(urlsplit(self.path).path)
        if path == "/api/repos/create":
            return self._create(json.loads(body))
        if path == "/api/validate-yaml":  # a README.md's metadata: accepted as it is
            return self._json({"errors": [], "warnings": []})
        match = _API_ROUTE.match(path)
        if not match or match.group(4) not in ("preupload", "commit", "branch", "settings"):
            raise HubError(404, "NotFound", f"no route {path}")
        kind, org, name, action, revision, _ = match.groups()
        repo = self._repo(kind, org, name, write=True)
        with LOCK:
            if action == "settings":
                meta = repo.meta
                settings = json.loads(body)
                if "visibility" in settings:
                    meta["private"] = settings["visibility"] == "private"
                if "gated" in settings:
                    meta["gated"] = settings["gated"] or False
                repo.save_meta(meta)
                return self._json({})
            if action == "branch":
                meta = repo.meta
                if revision in meta["refs"]:
                    raise HubError(409, "Conflict", f"branch {revision} exists")
                start = (json.loads(body) if body else {}).get("startingPoint") or "main"
                meta["refs"][revision] = repo.commit(start)
                repo.save_meta(meta)
                return self._json({})
            if action == "preupload":
                files = json.loads(body)["files"]
                return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                              "oid": None} for f in files]})
            return self._commit(repo, kind, org, name, revision, body)

    def _create(self, request: dict) -> None:
        if not self._authorized():
            raise HubError(401, "Unauthorized", "creating a repo needs a token")
        kind = f"{request.get('type') or 'model'}s"
        org = request.get("organization") or "user"
        folder = self.root / kind / org / request["name"]
        prefix = "" if kind == "models" else f"{kind}/"
        answer = {"url": f"http://{self.headers['Host']}/{prefix}{org}/{request['name']}", "name": request["name"]}
        with LOCK:
            if (folder / "meta.json").is_file():  # the Hub's 409 names the repo's URL too
                return self._json({**answer, "error": "You already created this repo"}, status=409)
            (folder / "blobs").mkdir(parents=True)
            repo = Repo(folder)
            empty = repo.write_commit(None, {}, "initial commit")
            repo.save_meta({"private": request.get("visibility") == "private", "gated": False, "refs": {"main": empty}})
        self._json(answer)

    def _commit(self, repo: Repo, kind: str, org: str, name: str, revision: str, body: bytes) -> None:
        meta = repo.meta
        if revision not in meta["refs"]:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        parent = meta["refs"][revision]
        files = dict(repo.files(parent))
        summary = ""
        for line in body.splitlines():
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "header":
                summary = value.get("summary", "")
            elif item["key"] == "file":
                data = base64.b64decode(value["content"])
                sha = hashlib.sha256(data).hexdigest()
                repo.blob(sha).write_bytes(data)
                files[value["path"]] = sha
            elif item["key"] == "deletedFile":
                files.pop(value["path"], None)
            else:
                raise HubError(400, "BadRequest", f"unsupported commit operation {item['key']}")
        commit = repo.write_commit(parent, files, summary)
        meta["refs"][revision] = commit
        repo.save_meta(meta)
        prefix = "" if kind == "models" else f"{kind}/"
        self._json({"commitUrl": f"http://{self.headers['Host']}/{prefix}{org}/{name}/commit/{commit}",
                    "commitOid": commit, "pullRequestUrl": None})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--token", help="the one token that reads private repos and writes")
    parser.add_argument("--bytes-per-s", type=int, default=0, help="slow file bodies to this rate (0: full speed)")
    args = parser.parse_args(argv)
    Handler.root, Handler.token, Handler.bytes_per_s = Path(args.root), args.token, args.bytes_per_s
    Path(args.root).mkdir(parents=True, exist_ok=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
