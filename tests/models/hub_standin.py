"""A Hugging Face Hub stand-in on 127.0.0.1, for tests that download models by name
with no network: point ``HF_ENDPOINT`` at ``hub.url`` (in the downloading process's
environment only).

It answers what huggingface_hub (2.x) asks to list and fetch a model repository:

    GET  /api/models/{repo}[/revision/{rev}]   model_info: id, sha, siblings (rfilename)
    GET  /api/models/{repo}/tree/{rev}[/path]  list_repo_tree (snapshot_download): type, path, size, oid
    HEAD /{repo}/resolve/{rev}/{path}          X-Repo-Commit, ETag (the sha256), Content-Length
    GET  /{repo}/resolve/{rev}/{path}          the bytes; "Range: bytes=N-" answers 206 (resumes)

and fails as the Hub does, with its X-Error-Code header: RepoNotFound (401, as for an
anonymous caller), RevisionNotFound and EntryNotFound (404), GatedRepo (401 without a
token, 403 with a token that has no access; listing a gated repository stays open, as
on the Hub). It never sends a Xet header (X-Xet-*, a xet-auth link) nor a tree entry's
xetHash, so huggingface_hub downloads over plain HTTP. Anything else is a 404, recorded
in ``unknown_paths``.

Faults for the tests: ``drop_after[(repo, path)] = n`` closes the connection after n
bytes of the next GET of that file (once); ``fail_status[(repo, path)] = status``
answers every GET of it with that status.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_MODEL_API = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?")
_TREE_API = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?")
_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")
_CHUNK = 1 << 20


@dataclass
class Repo:
    """A model repository at one commit: repository path -> the local file served for it."""

    files: dict[str, str]
    sha: str
    branches: tuple[str, ...] = ("main",)
    gated_token: str | None = None  # set: the repository is gated; only this token has access
    _etags: dict[str, str] = field(default_factory=dict)

    def commit_of(self, revision: str) -> str | None:
        return self.sha if revision == self.sha or revision in self.branches else None

    def etag(self, path: str) -> str:
        if path not in self._etags:
            digest = hashlib.sha256()
            with open(self.files[path], "rb") as f:
                for chunk in iter(lambda: f.read(_CHUNK), b""):
                    digest.update(chunk)
            self._etags[path] = digest.hexdigest()
        return self._etags[path]


class StandInHub:
    """The server (``with StandInHub() as hub``); ``add_repo`` before a test downloads."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[dict[str, str | None]] = []  # method, path, range, authorization
        self.unknown_paths: list[str] = []
        self.drop_after: dict[tuple[str, str], int] = {}
        self.fail_status: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-standin", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_repo(self, repo_id: str, files: dict[str, str], *, gated_token: str | None = None) -> Repo:
        sha = hashlib.sha1(repo_id.encode()).hexdigest()
        self.repos[repo_id] = Repo(dict(files), sha, gated_token=gated_token)
        return self.repos[repo_id]

    def file_gets(self, repo_id: str | None = None) -> list[dict]:
        """The GETs of files (not of the API), of one repository if named."""
        prefix = f"/{repo_id}/resolve/" if repo_id else None
        with self._lock:
            return [r for r in self.requests if r["method"] == "GET" and "/resolve/" in r["path"]
                    and (prefix is None or r["path"].startswith(prefix))]

    def clear_log(self) -> None:
        with self._lock:
            self.requests.clear()
            self.unknown_paths.clear()

    def __enter__(self) -> "StandInHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def record(self, method: str, path: str, headers) -> None:
        with self._lock:
            self.requests.append({"method": method, "path": path, "range": headers.get("Range"),
                                  "authorization": headers.get("Authorization")})


def _handler_for(hub: StandInHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: a dropped body ends it

        def log_message(self, *args) -> None:  # quiet: the tests read hub.requests
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.record(self.command, path, self.headers)
            if (match := _TREE_API.fullmatch(path)) and body:
                return self._tree(match["repo"], match["rev"], match["path"])
            if (match := _MODEL_API.fullmatch(path)) and body:
                return self._model_info(match["repo"], match["rev"] or "main")
            if match := _RESOLVE.fullmatch(path):
                return self._file(match["repo"], match["rev"], match["path"], body)
            with hub._lock:
                hub.unknown_paths.append(path)
            self._error(404, "NotFound", "Not found")

        # ------------------------------------------------------------ the API

        def _repo_at(self, repo_id: str, revision: str) -> tuple[Repo, str] | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(401, "RepoNotFound", "Repository not found")
                return None
            commit = repo.commit_of(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", "Invalid rev id: " + revision)
                return None
            return repo, commit

        def _model_info(self, repo_id: str, revision: str) -> None:
            found = self._repo_at(repo_id, revision)
            if found is not None:
                repo, commit = found
                self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                            "gated": "manual" if repo.gated_token else False, "disabled": False,
                            "siblings": [{"rfilename": p} for p in sorted(repo.files)]})

        def _tree(self, repo_id: str, revision: str, folder: str | None) -> None:
            found = self._repo_at(repo_id, revision)
            if found is not None:
                repo = found[0]
                prefix = folder.rstrip("/") + "/" if folder else ""
                self._json([{"type": "file", "path": p, "size": os.path.getsize(local),
                             "oid": hashlib.sha1(p.encode()).hexdigest()}
                            for p, local in sorted(repo.files.items()) if p.startswith(prefix)])

        # ------------------------------------------------------------ files

        def _file(self, repo_id: str, revision: str, path: str, body: bool) -> None:
            found = self._repo_at(repo_id, revision)
            if found is None:
                return
            repo, commit = found
            if repo.gated_token is not None and not self._may_read(repo):
                return
            if path not in repo.files:
                return self._error(404, "EntryNotFound", f"{path} does not exist", commit=commit)
            if body and (repo_id, path) in hub.fail_status:
                return self._error(hub.fail_status[(repo_id, path)], None, "Internal Error", commit=commit)
            local = repo.files[path]
            size = os.path.getsize(local)
            start = self._range_start() if body else 0
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{repo.etag(path)}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(size - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            self.end_headers()
            if body:
                self._send_bytes(local, start, hub.drop_after.pop((repo_id, path), None))

        def _may_read(self, repo: Repo) -> bool:
            given = self.headers.get("Authorization")
            if given is None:
                self._error(401, "GatedRepo", "Access to this model is restricted: log in")
                return False
            if given != f"Bearer {repo.gated_token}":
                self._error(403, "GatedRepo", "Access to this model is restricted: ask for access")
                return False
            return True

        def _range_start(self) -> int:
            match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
            return int(match[1]) if match else 0

        def _send_bytes(self, local: str, start: int, drop_after: int | None) -> None:
            """The file from ``start``; after ``drop_after`` bytes the connection just ends."""
            sent = 0
            with open(local, "rb") as f:
                f.seek(start)
                while chunk := f.read(_CHUNK):
                    if drop_after is not None and sent + len(chunk) > drop_after:
                        self.wfile.write(chunk[: drop_after - sent])
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    self.wfile.write(chunk)
                    sent += len(chunk)

        # ------------------------------------------------------------ answers

        def _json(self, value) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code is not None:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit is not None:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


# ---------------------------------------------------------------- the tests' repositories

GGUF_REPO = "cadence-test/SmolLM2-135M-Instruct-GGUF"
TINY_REPO = "cadence-test/tiny-llama"  # safetensors
GATED_REPO = "cadence-test/gated-GGUF"
GATED_TOKEN = "hf_cadence_test_token"
GGUF_DEFAULT_FILE = "SmolLM2-135M-Instruct-Q4_K_M.gguf"
GGUF_SHARDS = tuple(f"SmolLM2-135M-Instruct-Q4_1-{no:05d}-of-00003.gguf" for no in (1, 2, 3))
# What a safetensors model fetch must leave alone: other formats, a second copy of the weights.
TINY_UNWANTED = ("pytorch_model.bin", "consolidated.safetensors", "original/params.json")


def add_test_repos(hub: StandInHub, folder: str) -> None:
    """The default model's GGUF (under a Q4_K_M name: the label is only a name here) beside
    its Q4_1 split in three shards and a vision projector; a tiny random Llama as a
    sharded safetensors checkpoint (index) with files a fetch must skip; a gated repository."""
    from cadence.models.default_model import default_model_path
    from tests.models.gguf_split_helpers import write_split

    default = default_model_path()
    shards = write_split(default, os.path.join(folder, "split.gguf"), 3)
    junk = os.path.join(folder, "junk.bin")
    with open(junk, "wb") as f:
        f.write(b"not a model\n")
    hub.add_repo(GGUF_REPO, {GGUF_DEFAULT_FILE: default, **dict(zip(GGUF_SHARDS, map(str, shards))),
                             "mmproj-SmolLM2-135M-F16.gguf": junk, "README.md": junk})
    tiny = write_tiny_sharded_checkpoint(os.path.join(folder, "tiny"))
    hub.add_repo(TINY_REPO, {**tiny, **{name: junk for name in TINY_UNWANTED}})
    hub.add_repo(GATED_REPO, {"gated-Q4_K_M.gguf": junk}, gated_token=GATED_TOKEN)


def write_tiny_sharded_checkpoint(folder: str) -> dict[str, str]:
    """A tiny random Llama folder (``write_hf_folder``) with its weights in two
    safetensors files and an index; repository path -> local file."""
    from safetensors.torch import load_file, save_file

    from cadence.models.testing import random_model, tiny_config, write_hf_folder

    write_hf_folder(folder, random_model(tiny_config(), seed=5))
    whole = os.path.join(folder, "model.safetensors")
    tensors = load_file(whole)
    os.remove(whole)
    names = sorted(tensors)
    weight_map = {}
    for no, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), start=1):
        file = f"model-{no:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, os.path.join(folder, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return {name: os.path.join(folder, name) for name in os.listdir(folder)}


def hub_env(hub: StandInHub | None, folder: str, **extra: str) -> dict[str, str]:
    """This process's environment without its Hugging Face settings, plus the stand-in's:
    HF_ENDPOINT (``hub.url``; None: a closed port, no network), a fresh HF_HOME and cache
    under ``folder``, HF_HUB_OFFLINE off; ``extra`` last (e.g. HF_HUB_OFFLINE="1")."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_")) and k != "TRANSFORMERS_OFFLINE"}
    env.update(HF_ENDPOINT=hub.url if hub is not None else f"http://127.0.0.1:{closed_port()}",
               HF_HOME=os.path.join(folder, "hf_home"), HF_HUB_CACHE=os.path.join(folder, "cache"),
               HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def closed_port() -> int:
    """A loopback port nothing listens on (connections are refused at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
