"""A local stand-in for the Hugging Face Hub, to test real uploads (``push_to_hub``) without the network.

:class:`MockHub` is a small HTTP server on ``127.0.0.1`` (a free port, a background thread) that answers the few
endpoints `huggingface_hub` calls to create a repository, upload a folder and read it back. It keeps everything in
memory: each repository's id, type, private flag, commits and files (path → bytes). :func:`use_hub` points
`huggingface_hub` and `transformers` at it for the duration of a ``with`` block.

Endpoints (``{kind}`` is ``models``, ``datasets`` or ``spaces``; ``{repo}`` is ``namespace/name``):

- ``GET /api/whoami-v2``: the token check (401 with a wrong or missing token).
- ``POST /api/repos/create``: create a repository (409 if it exists, 403 outside the user's namespaces).
- ``GET /api/{kind}/{repo}`` and ``/api/{kind}/{repo}/revision/{rev}``: `repo_info` / `model_info` (a private
  repository is only visible with the token, as on the Hub: 404 otherwise).
- ``POST /api/{kind}/{repo}/preupload/{rev}``: every file is answered ``"regular"``, so that `huggingface_hub` sends
  the contents inline (base64) in the commit, with or without `hf_xet` installed: no LFS or Xet transfer is ever
  asked for. The existing blob id is returned, so that unchanged files are skipped as on the Hub.
- ``POST /api/{kind}/{repo}/commit/{rev}``: the NDJSON commit (header, ``file``, ``deletedFile``,
  ``deletedFolder``); ``lfsFile`` entries and pull requests are refused (400).
- ``GET /api/{kind}/{repo}/tree/{rev}[/{path}]``: `list_repo_tree` / `list_repo_files`.
- ``POST /api/validate-yaml``: accepts the model card metadata.
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` (``/{kind}/{repo}/...`` for the other kinds): file downloads, so
  that ``from_pretrained("namespace/name")`` can read an upload back.

It is bounded: a request body over ``max_body_bytes`` is refused (413), and the server stops by itself after
``lifetime_s`` seconds (or when the ``with`` block ends).

Example:

    from huggingface_hub import HfApi
    from trl_ext.testing.mock_hub import MockHub, use_hub

    with MockHub() as hub, use_hub(hub.url, token=hub.token):
        HfApi().create_repo("user/demo", private=True)
        HfApi().upload_folder(repo_id="user/demo", folder_path="out")
        assert hub.repo("user/demo").private and "config.json" in hub.repo("user/demo").files
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["MockCommit", "MockHub", "MockRepo", "use_hub"]

KINDS = {"models": "model", "datasets": "dataset", "spaces": "space"}
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_id(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as a regular file's ``oid``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class MockCommit:
    """One commit: its id, message, parent and the full file tree after it."""

    oid: str
    message: str
    parent: str | None
    files: dict[str, bytes]


@dataclass
class MockRepo:
    """A repository of the mock Hub."""

    repo_id: str
    repo_type: str
    private: bool
    commits: dict[str, MockCommit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)

    @property
    def files(self) -> dict[str, bytes]:
        """The files of ``main`` (path → contents)."""
        return self.commits[self.branches["main"]].files

    @property
    def history(self) -> list[MockCommit]:
        """The commits of ``main``, oldest first."""
        out, oid = [], self.branches["main"]
        while oid is not None:
            out.append(self.commits[oid])
            oid = self.commits[oid].parent
        return out[::-1]

    def resolve(self, revision: str) -> MockCommit | None:
        """The commit of a branch name or a commit id, ``None`` if there is none."""
        oid = self.branches.get(revision, revision)
        return self.commits.get(oid)

    def commit(self, branch: str, message: str, files: dict[str, bytes]) -> MockCommit:
        parent = self.branches.get(branch)
        digest = hashlib.sha1(f"{self.repo_id}\0{parent}\0{message}\0{time.time_ns()}".encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + git_blob_id(files[path]).encode())
        commit = MockCommit(digest.hexdigest(), message, parent, files)
        self.commits[commit.oid] = commit
        self.branches[branch] = commit.oid
        return commit


class HubError(Exception):
    """An error answered to the client: HTTP status, message, the Hub's ``X-Error-Code`` (if any) and more JSON fields
    (the Hub's 409 on an existing repository gives its ``url``)."""

    def __init__(self, status: int, message: str, code: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


class MockHub:
    """In-memory Hub served on ``127.0.0.1`` (see the module docs). Use it as a context manager, or call
    :meth:`start` and :meth:`stop`.

    Args:
        user: the user the token belongs to (its namespace).
        token: the only valid token.
        orgs: other namespaces the user may create repositories in.
        lifetime_s: the server stops by itself after this many seconds.
        max_body_bytes: larger request bodies are refused (413).
    """

    def __init__(
        self,
        user: str = "user",
        token: str = "hf_mock_token",
        orgs: tuple[str, ...] = (),
        lifetime_s: float = 300.0,
        max_body_bytes: int = 256 * 2**20,
    ):
        self.user, self.token, self.orgs = user, token, tuple(orgs)
        self.lifetime_s, self.max_body_bytes = lifetime_s, max_body_bytes
        self.repos: dict[tuple[str, str], MockRepo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None

    # -------------------------------------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        """The endpoint, e.g. ``http://127.0.0.1:54321`` (set once started)."""
        if self._server is None:
            raise RuntimeError("The mock Hub is not running: call start() or use it in a `with` block.")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> MockHub:
        if self._server is not None:
            return self
        hub = self

        class Handler(_Handler):
            mock = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="mock-hub", daemon=True)
        self._thread.start()
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def __enter__(self) -> MockHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------------------------------------- the store
    def repo(self, repo_id: str, repo_type: str = "model") -> MockRepo:
        """The stored repository (``KeyError`` if it was never created)."""
        with self.lock:
            return self.repos[(repo_type, repo_id)]

    def create(self, repo_id: str, repo_type: str = "model", private: bool = False) -> MockRepo:
        """Create a repository directly in the store, with the Hub's initial ``.gitattributes`` commit."""
        repo = MockRepo(repo_id, repo_type, private)
        repo.commit("main", "initial commit", {".gitattributes": GITATTRIBUTES})
        with self.lock:
            self.repos[(repo_type, repo_id)] = repo
        return repo

    # ---------------------------------------------------------------------------------------- request logic
    def authorized(self, headers) -> bool:
        return headers.get("Authorization", "") == f"Bearer {self.token}"

    def _readable(self, kind: str, repo_id: str, authorized: bool) -> MockRepo:
        with self.lock:
            repo = self.repos.get((KINDS[kind], repo_id))
        if repo is None or (repo.private and not authorized):
            raise HubError(404, f"Repository Not Found for url: {kind}/{repo_id}.", "RepoNotFound")
        return repo

    def _writable(self, kind: str, repo_id: str, authorized: bool) -> MockRepo:
        if not authorized:
            raise HubError(401, "Invalid credentials in Authorization header")
        repo = self._readable(kind, repo_id, authorized)
        if repo_id.split("/")[0] not in (self.user, *self.orgs):
            raise HubError(403, f"You don't have the rights to write to {repo_id}.")
        return repo

    @staticmethod
    def _commit_of(repo: MockRepo, revision: str) -> MockCommit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def whoami(self, authorized: bool) -> dict:
        if not authorized:
            raise HubError(401, "Invalid credentials in Authorization header")
        return {
            "type": "user", "name": self.user, "fullname": self.user, "email": None, "emailVerified": False,
            "orgs": [{"type": "org", "name": org} for org in self.orgs],
            "auth": {"type": "access_token", "accessToken": {"displayName": "mock", "role": "write"}},
        }  # fmt: skip

    def create_repo(self, body: dict, authorized: bool) -> dict:
        if not authorized:
            raise HubError(401, "Invalid credentials in Authorization header")
        namespace, name = body.get("organization") or self.user, body.get("name")
        repo_type = body.get("type") or "model"
        if not name or repo_type not in KINDS.values():
            raise HubError(400, f"Invalid repository name or type: {name!r}, {repo_type!r}.")
        if namespace not in (self.user, *self.orgs):
            raise HubError(403, f"You don't have the rights to create a {repo_type} under {namespace}.")
        repo_id = f"{namespace}/{name}"
        url = self.repo_url(repo_id, repo_type)
        with self.lock:
            if (repo_type, repo_id) in self.repos:
                raise HubError(409, f"You already created this {repo_type} repo: {repo_id}", url=url)
            self.create(repo_id, repo_type, private=body.get("visibility", body.get("private")) in ("private", True))
        return {"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]}

    def repo_url(self, repo_id: str, repo_type: str = "model") -> str:
        return f"{self.url}/{repo_id}" if repo_type == "model" else f"{self.url}/{repo_type}s/{repo_id}"

    def info(self, kind: str, repo_id: str, revision: str | None, authorized: bool) -> dict:
        repo = self._readable(kind, repo_id, authorized)
        commit = self._commit_of(repo, revision or "main")
        info = {
            "id": repo_id, "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "author": repo_id.split("/")[0],
            "sha": commit.oid, "private": repo.private, "gated": False, "disabled": False, "tags": _card_tags(commit),
            "siblings": [{"rfilename": path} for path in sorted(commit.files)],
            "lastModified": "2025-01-01T00:00:00.000Z", "createdAt": "2025-01-01T00:00:00.000Z",
        }  # fmt: skip
        if repo.repo_type == "space":
            info["sdk"] = "static"
        return info

    def preupload(self, kind: str, repo_id: str, revision: str, body: dict, authorized: bool) -> dict:
        repo = self._writable(kind, repo_id, authorized)
        files = self._commit_of(repo, revision).files if repo.resolve(revision) else {}
        answer = []
        for item in body.get("files", []):
            existing = files.get(item["path"])
            oid = git_blob_id(existing) if existing is not None else None
            answer.append({"path": item["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": oid})
        return {"files": answer, "commitOid": repo.branches.get(revision)}

    def commit(self, kind: str, repo_id: str, revision: str, lines: list[dict], query: dict, authorized: bool) -> dict:
        repo = self._writable(kind, repo_id, authorized)
        if query.get("create_pr"):
            raise HubError(400, "The mock Hub does not support pull requests.")
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The commit payload must start with a header line.")
        header = lines[0]["value"]
        with self.lock:
            base = self._commit_of(repo, revision)
            if revision not in repo.branches:
                raise HubError(400, f"Commits go to a branch, not to {revision}.")
            if header.get("parentCommit") and header["parentCommit"] != base.oid:
                raise HubError(412, "A commit has happened since the parent commit. Please retry.")
            files = dict(base.files)
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                if key == "file":
                    files[value["path"]] = _decode_content(value)
                elif key == "deletedFile":
                    if files.pop(value["path"], None) is None:
                        raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: d for p, d in files.items() if not p.startswith(prefix)}
                else:  # lfsFile: never asked for (every preupload is answered "regular")
                    raise HubError(400, f"The mock Hub does not accept {key!r} commit entries.")
            commit = repo.commit(revision, header.get("summary", ""), files)
        return {
            "success": True, "commitOid": commit.oid, "commitMessage": commit.message,
            "commitUrl": f"{self.repo_url(repo_id, repo.repo_type)}/commit/{commit.oid}", "pullRequestUrl": None,
        }  # fmt: skip

    def tree(self, kind: str, repo_id: str, revision: str, path: str, query: dict, authorized: bool) -> list[dict]:
        repo = self._readable(kind, repo_id, authorized)
        files = self._commit_of(repo, revision).files
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        if prefix and not any(p.startswith(prefix) for p in files):
            raise HubError(404, f"{path} does not exist on {revision}", "EntryNotFound")
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        entries: dict[str, dict] = {}
        for name in sorted(files):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix) :].split("/")
            for depth in range(1, len(parts)):  # the folders on the way
                folder = prefix + "/".join(parts[:depth])
                entries.setdefault(folder, {"type": "directory", "path": folder, "oid": git_blob_id(folder.encode())})
                if not recursive:
                    break
            if recursive or len(parts) == 1:
                entries[name] = {
                    "type": "file",
                    "path": name,
                    "size": len(files[name]),
                    "oid": git_blob_id(files[name]),
                }
        return list(entries.values())

    def download(self, kind: str, repo_id: str, revision: str, path: str, authorized: bool):
        repo = self._readable(kind, repo_id, authorized)
        commit = self._commit_of(repo, revision)
        if path not in commit.files:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        return commit, commit.files[path]


def _decode_content(value: dict) -> bytes:
    content = value.get("content", "")
    if value.get("encoding") == "base64":
        return base64.b64decode(content)
    return content.encode()


def _card_tags(commit: MockCommit) -> list[str]:
    """The ``tags`` of the README's YAML metadata (a plain reading of ``tags:`` list items)."""
    text = commit.files.get("README.md", b"").decode(errors="replace")
    if not text.startswith("---"):
        return []
    tags, inside = [], False
    for line in text.split("---", 2)[1].splitlines():
        if line.startswith("tags:"):
            inside = True
        elif inside and line.lstrip().startswith("- "):
            tags.append(line.strip()[2:].strip())
        elif inside and line.strip():
            inside = False
    return tags


class _Handler(BaseHTTPRequestHandler):
    """Routes a request to :class:`MockHub` and writes the JSON answer (or the error the Hub would send)."""

    mock: MockHub
    protocol_version = "HTTP/1.1"
    timeout = 60  # seconds a connection may stay silent

    def log_message(self, format, *args):  # quiet (the default prints every request to stderr)
        return

    def do_GET(self):
        self._handle("GET")

    def do_HEAD(self):
        self._handle("HEAD")

    def do_POST(self):
        self._handle("POST")

    def _handle(self, method: str) -> None:
        hub = self.mock
        split = urlsplit(self.path)
        with hub.lock:
            hub.requests.append((method, split.path))
        try:
            body = self._read_body()
            self._route(method, [unquote(s) for s in split.path.strip("/").split("/")], parse_qs(split.query), body)
        except HubError as e:
            self._send_json(
                e.status, {"error": e.message, **e.extra}, {"X-Error-Code": e.code, "X-Error-Message": e.message}
            )
        except Exception as e:  # a bug of the mock: answer 500 rather than hang the client
            self._send_json(500, {"error": f"mock Hub error: {type(e).__name__}: {e}"})

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > self.mock.max_body_bytes:
            self.close_connection = True
            raise HubError(413, f"Request body of {length} bytes over the mock Hub's limit.")
        return self.rfile.read(length) if length else b""

    def _route(self, method: str, parts: list[str], query: dict, body: bytes) -> None:
        hub, authorized = self.mock, self.mock.authorized(self.headers)
        if parts[0] == "api":
            api = parts[1:]
            if method == "GET" and api == ["whoami-v2"]:
                return self._send_json(200, hub.whoami(authorized))
            if method == "POST" and api == ["repos", "create"]:
                return self._send_json(200, hub.create_repo(json.loads(body or b"{}"), authorized))
            if method == "POST" and api == ["validate-yaml"]:
                return self._send_json(200, {"errors": [], "warnings": []})
            if len(api) >= 3 and api[0] in KINDS:
                kind, repo_id, rest = api[0], f"{api[1]}/{api[2]}", api[3:]
                if method == "GET" and not rest:
                    return self._send_json(200, hub.info(kind, repo_id, None, authorized))
                if method == "GET" and len(rest) == 2 and rest[0] == "revision":
                    return self._send_json(200, hub.info(kind, repo_id, rest[1], authorized))
                if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
                    return self._send_json(200, hub.preupload(kind, repo_id, rest[1], json.loads(body), authorized))
                if method == "POST" and len(rest) == 2 and rest[0] == "commit":
                    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                    return self._send_json(200, hub.commit(kind, repo_id, rest[1], lines, query, authorized))
                if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
                    path = "/".join(rest[2:])
                    return self._send_json(200, hub.tree(kind, repo_id, rest[1], path, query, authorized))
        elif method in ("GET", "HEAD"):
            kind = parts[0] if parts[0] in ("datasets", "spaces") else "models"
            repo_parts = parts[1:] if kind != "models" else parts
            if len(repo_parts) >= 5 and repo_parts[2] == "resolve":
                repo_id, revision, path = "/".join(repo_parts[:2]), repo_parts[3], "/".join(repo_parts[4:])
                commit, data = hub.download(kind, repo_id, revision, path, authorized)
                headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{git_blob_id(data)}"'}
                return self._send_bytes(200, data, "application/octet-stream", headers, head=method == "HEAD")
        raise HubError(404, f"The mock Hub has no route for {method} {'/'.join(parts)}.")

    def _send_json(self, status: int, payload, headers: dict | None = None) -> None:
        self._send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

    def _send_bytes(self, status: int, data: bytes, content_type: str, headers=None, head: bool = False) -> None:
        self.send_response(status)
        self.close_connection = True  # one request per connection: once stopped, the mock answers nothing more
        self.send_header("Connection", "close")
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            if value is not None:
                self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(data)


@contextlib.contextmanager
def use_hub(endpoint: str, token: str | None = None, disable_xet: bool = False) -> Iterator[None]:
    """Point `huggingface_hub` and `transformers` at ``endpoint`` (online) within the block, then restore them.

    ``HF_ENDPOINT`` is read once, when `huggingface_hub` is imported; a process that imported it already is pointed
    at ``endpoint`` by patching what was derived from it: ``huggingface_hub.constants.ENDPOINT`` (read by every new
    `HfApi`), the download URL template, the default `HfApi` of the module-level functions and the `HfApi` that
    `transformers` caches (its `Trainer` pushes through it). Offline mode (``HF_HUB_OFFLINE``, also read at import)
    is turned off. ``HF_ENDPOINT``, ``HF_HUB_OFFLINE=0`` and ``HF_TOKEN`` (if ``token``) are also set in the
    environment, for subprocesses. ``disable_xet=True`` takes the upload path of an install without `hf_xet`
    (``HF_HUB_DISABLE_XET``)."""
    from huggingface_hub import constants
    from huggingface_hub import hf_api as hub_api

    endpoint = endpoint.rstrip("/")
    saved_constants = {
        name: getattr(constants, name)
        for name in ("ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_XET")
    }
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    if token is not None:
        env["HF_TOKEN"] = token
    if disable_xet:
        env["HF_HUB_DISABLE_XET"] = "1"
    saved_env = {name: os.environ.get(name) for name in env}
    saved_api_endpoint = hub_api.api.endpoint
    transformers_hub = _transformers_hub()
    saved_transformers_api = getattr(transformers_hub, "_hf_api", None)
    try:
        constants.ENDPOINT = endpoint
        constants.HUGGINGFACE_CO_URL_TEMPLATE = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        constants.HF_HUB_OFFLINE = False
        constants.HF_HUB_DISABLE_XET = disable_xet or saved_constants["HF_HUB_DISABLE_XET"]
        os.environ.update(env)
        hub_api.api.endpoint = endpoint
        if transformers_hub is not None:
            transformers_hub._hf_api = None  # rebuilt on first use, with the new endpoint
        yield
    finally:
        for name, value in saved_constants.items():
            setattr(constants, name, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        hub_api.api.endpoint = saved_api_endpoint
        if transformers_hub is not None:
            transformers_hub._hf_api = saved_transformers_api


def _transformers_hub():
    """``transformers.utils.hub`` if transformers is installed and caches its `HfApi` there, else ``None``."""
    try:
        from transformers.utils import hub
    except ImportError:  # pragma: no cover - transformers is a dependency of trl_ext
        return None
    return hub if hasattr(hub, "_hf_api") else None
