"""A stand-in for the Hugging Face hub's HTTP endpoints, on 127.0.0.1, for tests/test_hub.py.

It serves, from memory, only the files it is given: model repositories (`org/name`), each
a list of commits (oldest first, the last one is `main`), each commit the files of one
local folder. Nothing leaves the machine: the server binds 127.0.0.1 only, and a
process pointed at it with `HF_ENDPOINT=http://127.0.0.1:PORT` asks it, not the hub.

The endpoints are those mergekit 0.1.5, transformers 5 and huggingface_hub 1.16 to 2.4 call for a
hub id (found by reading their code and by logging requests; see `requests`):

* `GET /api/models/{repo}` and `GET /api/models/{repo}/revision/{revision}` (`repo_info`:
  transformers' `AutoConfig.from_pretrained` resolving the default branch, and
  `snapshot_download` resolving a branch, and a commit hash with huggingface_hub 1.16): JSON
  `{"id", "sha", "siblings"}`, `sha` the commit the revision names;
* `GET /api/models/{repo}/tree/{revision}` (`list_repo_tree`: mergekit's `list_repo_files`,
  then `snapshot_download`'s listing; `recursive`/`expand` ignored, the repositories are
  flat): JSON `[{"type": "file", "path", "size", "oid", "lfs"?}]`, one page (no `Link`
  header). `.../tree/{revision}/{folder}` (transformers' chat-template look-up, when a
  tokenizer is copied) answers EntryNotFound: there are no folders;
* `HEAD` and `GET /{repo}/resolve/{revision}/{filename}` (`hf_hub_download`, by commit hash
  from `snapshot_download` and transformers): 200 with `X-Repo-Commit` (the commit),
  `ETag` (quoted: the git blob sha1, or the sha256 for a `.safetensors` file, which the hub
  stores in LFS; `X-Linked-Etag` and `X-Linked-Size` the same for those), `Content-Length`,
  and the file's bytes for GET. No Xet headers (so no Xet transfer). With `redirect` (as the Hub does for files
  stored in LFS), a `.safetensors`/`.bin` file answers 302 instead, carrying `X-Repo-Commit`, `X-Linked-Etag`,
  `X-Linked-Size` and `ETag`, to `Location` on another origin (a second server, `cdn_url`) that serves the bytes
  and ranges without any commit header. A GET with `Range: bytes=A-B`
  (or `bytes=A-`) answers 206 with `Content-Range: bytes A-B/SIZE` and those bytes, as the hub does; a range past
  the end, 416. `ranges` chooses a server that does otherwise: "ignore" (200, the whole file), "short" (one byte
  fewer than the Content-Range says), "shifted" (the bytes one further on than the Content-Range says), "stall"
  (a range reaching into a file's second half waits until the server closes, sending nothing). `sent`
  records (path, the Range asked or None, the bytes of the body) of every file's GET (the Hub's path, also for
  the bytes the other origin sends).

* `GET /api/models/{repo}/commits/{revision}` (`HfApi.list_repo_commits`: verify's `history`, finding the
  commit of an unpinned input current when a merge was published): JSON, newest first, the commits from the
  revision back to the repository's first (the commits `squash` removed left out),
  `[{"id", "title", "message", "authors": [{"user"}], "date"}]`, `date` as the Hub writes it
  (`2024-01-01T00:00:00.000Z`). One page, unless `commits_page` is set: then that many commits a page, the next
  page (`?p=N`, from 0) named in a `Link: <URL>; rel="next"` header, which huggingface_hub's `paginate` follows.
  A commit's date is `set_date`'s, else increasing: one hour apart, in the order the commits were given (all
  repositories' together, so a repository given later is newer). A commit's weight files and their LFS sha256
  are its tree's (`list_repo_tree(repo, revision=commit)`, above).

What a repository can be made to be, after the stub starts (each named by its id; see the methods):
`squash(repo, n)` removes its commits before the n-th (its history before then squashed away: they are no
longer in its history, and asking for one answers RevisionNotFound); `rename(old, new)`: every request naming
`old` answers 307 with a relative `Location` naming `new` (as the Hub redirects a renamed repository), which
huggingface_hub follows; `gate(repo)`: its metadata (`"gated": "manual"`), tree and history answer, its files
answer 401 (403 with an `Authorization` header) with `X-Error-Code: GatedRepo` (huggingface_hub's
GatedRepoError); `make_private(repo)`: every request about it answers 401 with `X-Error-Code: RepoNotFound` (a
private repository, asked without a token: RepositoryNotFoundError, as for one deleted).

A revision is `main` or a full commit hash of that repository. Anything else answers 404
with the `X-Error-Code` the hub sends (`RepoNotFound`, `RevisionNotFound`,
`EntryNotFound`), so huggingface_hub raises its usual errors; every request is recorded
(`requests`) so a test can say which endpoints were used, or that none was.

The server stops by itself after `lifetime` seconds, and at `close()` (a context manager).

A link between the client and the Hub (issue 71: what a request costs a stranger on an ordinary network), both
servers behind it: `latency` (seconds) is waited once per request, after the request is read and before it is
answered (a round trip), and once more per new connection (its handshake); `bandwidth` (bytes per second) is
shared by every answer of both origins, each sent in 64 KiB pieces paced at that rate. With either, connections
are kept open between requests (HTTP/1.1), as the Hub's are. `link.connections` and `link.requests` count what
came through it. Without them, answers are as fast as the machine gives.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")


@dataclass(frozen=True)
class Blob:
    data: bytes
    git_sha1: str
    sha256: str

    @classmethod
    def of(cls, data: bytes) -> Blob:
        git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        return cls(data, git, hashlib.sha256(data).hexdigest())


@dataclass
class Repo:
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)  # sha -> filename -> blob, oldest first
    main: str = ""
    dates: dict[str, datetime] = field(default_factory=dict)  # sha -> its date, where `set_date` gave one
    renamed_to: str | None = None  # `rename`: every request is redirected there
    gated: bool = False
    private: bool = False


#: the date of the first commit given, when `set_date` gives none (each next commit one hour later)
FIRST_DATE = datetime(2024, 1, 1, tzinfo=timezone.utc)


def commit_sha(repo_id: str, number: int) -> str:
    """A made-up, stable, 40-hex commit hash."""
    return hashlib.sha1(f"{repo_id}#{number}".encode()).hexdigest()


def read_folder(folder: Path) -> dict[str, Blob]:
    """Every plain file directly in `folder` (the test models are flat)."""
    return {p.name: Blob.of(p.read_bytes()) for p in sorted(Path(folder).iterdir()) if p.is_file()}


class HubStub:
    """`HubStub({"org/name": [folder_v1, folder_v2]})`: org/name with two commits, main = v2.

    `url` is the HF_ENDPOINT to give; `shas["org/name"]` the commit hashes, oldest first;
    `requests` the (method, path with query, status answered) of every request, in order."""

    def __init__(
        self,
        repos: Mapping[str, Sequence[Path]],
        *,
        lifetime: float = 120.0,
        ranges: str = "honour",
        redirect: bool = False,
        latency: float = 0.0,
        bandwidth: float | None = None,
    ):
        assert ranges in ("honour", "ignore", "short", "shifted", "stall"), ranges
        self.link = Link(latency, bandwidth) if latency or bandwidth else None  # a link's cost (below), or none
        self.ranges, self.redirect = ranges, redirect
        self._closing = threading.Event()
        self.sent: list[tuple[str, str | None, int]] = []
        self.repos: dict[str, Repo] = {}
        self.shas: dict[str, list[str]] = {}
        for repo_id, folders in repos.items():
            repo = Repo()
            for number, folder in enumerate(folders, start=1):
                sha = commit_sha(repo_id, number)
                repo.commits[sha] = read_folder(folder)
                repo.main = sha
            self.repos[repo_id] = repo
            self.shas[repo_id] = list(repo.commits)
        self.requests: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                stub._answer(self, body=True)

            def do_HEAD(self):
                stub._answer(self, body=False)

            def log_message(self, format, *args):  # quiet: `requests` records what came
                pass

        class Origin(BaseHTTPRequestHandler):  # the other origin a redirect points to (the Hub's CDN)
            def do_GET(self):
                stub._origin(self, body=True)

            def do_HEAD(self):
                stub._origin(self, body=False)

            def log_message(self, format, *args):
                pass

        Handler, Origin = shaped(Handler, self.link), shaped(Origin, self.link)  # type: ignore[misc]
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), Origin)
        self._cdn.daemon_threads = True
        self.cdn_url = f"http://localhost:{self._cdn.server_address[1]}"  # another origin: another host and port
        self._cdn_thread = threading.Thread(target=self._cdn.serve_forever, name="hub-stub-cdn", daemon=True)
        self._cdn_thread.start()
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-stub", daemon=True)
        self._timer = threading.Timer(lifetime, self._stop)
        self._timer.daemon = True
        self._closed = False
        self._thread.start()
        self._timer.start()

    # ------------------------------------------------------------ lifetime

    def _stop(self) -> None:
        self._closing.set()  # a stalled answer ends
        for server in (self._server, self._cdn):
            server.shutdown()  # returns once serve_forever has stopped (at once if it already has)
            server.server_close()  # later connections are refused, not left waiting

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        self._stop()
        self._thread.join(timeout=10)

    def __enter__(self) -> HubStub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ history (list_repo_commits)

    #: commits per page of a repository's history (None: one page), as the Hub pages a long one
    commits_page: int | None = None

    def _sha(self, repo_id: str, number: int) -> str:
        return self.shas[repo_id][number - 1]

    def set_date(self, repo_id: str, number: int, when: datetime | str) -> None:
        """The date of `repo_id`'s `number`-th commit (from 1): an aware datetime, or ISO 8601 text."""
        when = datetime.fromisoformat(when.replace("Z", "+00:00")) if isinstance(when, str) else when
        assert when.tzinfo is not None, "a commit's date names its time zone, as the Hub's do"
        self.repos[repo_id].dates[self._sha(repo_id, number)] = when

    def date(self, repo_id: str, sha: str) -> datetime:
        """A commit's date: `set_date`'s, else one hour after the commit given before it (in any repository)."""
        given = self.repos[repo_id].dates.get(sha)
        if given is not None:
            return given
        order = list(dict.fromkeys(s for shas in self.shas.values() for s in shas))  # a renamed repo's, once
        return FIRST_DATE + timedelta(hours=order.index(sha))

    def squash(self, repo_id: str, number: int) -> None:
        """Remove `repo_id`'s commits before its `number`-th: its history before then squashed away. (The Hub's
        super-squash also makes one new commit of them; what verify meets is the same: those commits are gone.)"""
        repo = self.repos[repo_id]
        for sha in self.shas[repo_id][: number - 1]:
            repo.commits.pop(sha, None)

    def rename(self, old: str, new: str) -> None:
        """`old` becomes `new`: its commits are `new`'s, and a request naming `old` is redirected (307)."""
        self.repos[new] = self.repos.pop(old)
        self.repos[old] = Repo(renamed_to=new)
        self.shas[new] = self.shas[old]

    def gate(self, repo_id: str) -> None:
        """Its files answer 401/403 GatedRepo; its metadata says `"gated": "manual"`."""
        self.repos[repo_id].gated = True

    def make_private(self, repo_id: str) -> None:
        """Every request about it answers 401 RepoNotFound, as the Hub answers for a private one without a token."""
        self.repos[repo_id].private = True

    def _refused(self, handler, parts: list[str], body: bool) -> bool:
        """Answered (and True) when the repository a request names is renamed, private, or gated for a file."""
        api = parts[:2] == ["api", "models"] and len(parts) >= 4
        if not api and not (len(parts) >= 5 and parts[2] == "resolve"):
            return False
        at = 2 if api else 0
        repo = self.repos.get(f"{parts[at]}/{parts[at + 1]}")
        if repo is None:
            return False
        if repo.renamed_to is not None:
            path = "/".join([*parts[:at], repo.renamed_to, *parts[at + 2 :]])
            query = urlsplit(handler.path).query
            headers = {"Location": f"/{path}" + (f"?{query}" if query else "")}  # relative, as the Hub's
            self._send(handler, 307, b"", headers, body)
            return True
        if repo.private:
            headers = {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Invalid username or password."}
            self._send(handler, 401, b"", headers, body)
            return True
        if repo.gated and not api:
            status = 403 if handler.headers.get("Authorization") else 401
            headers = {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this model is restricted (stub)"}
            self._send(handler, status, b"", headers, body)
            return True
        return False

    def _commits(self, handler, repo_id: str, revision: str, body: bool) -> None:
        repo, sha = self._commit(repo_id, revision)
        if sha is None:
            return self._missing(handler, repo, body)
        kept = list(repo.commits)  # oldest first, the squashed ones removed
        history = kept[: kept.index(sha) + 1][::-1]
        numbers = {s: n for n, s in enumerate(self.shas[repo_id], start=1)}
        items = [
            {"id": s, "title": f"commit {numbers[s]}", "message": "", "authors": [{"user": "hub-stub"}],
             "date": self.date(repo_id, s).astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"}
            for s in history
        ]
        headers = {}
        if self.commits_page:
            found = re.search(r"(?:^|&)p=(\d+)", urlsplit(handler.path).query)
            page = int(found[1]) if found else 0
            size = self.commits_page
            items, more = items[page * size : (page + 1) * size], len(items) > (page + 1) * size
            if more:
                path = urlsplit(handler.path).path
                headers["Link"] = f'<{self.url}{path}?p={page + 1}>; rel="next"'
        self._json(handler, items, headers, body)

    # ------------------------------------------------------------ requests

    def _commit(self, repo_id: str, revision: str) -> tuple[Repo | None, str | None]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, None
        sha = repo.main if revision == "main" else revision
        return repo, sha if sha in repo.commits else None

    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        parts = [unquote(p) for p in urlsplit(handler.path).path.split("/")[1:]]
        if self._refused(handler, parts, body):
            return None
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
            if len(rest) == 2 and rest[0] == "commits":
                return self._commits(handler, repo_id, rest[1], body)
            if rest == [] or (len(rest) == 2 and rest[0] == "revision"):
                return self._info(handler, repo_id, rest[1] if rest else "main", body)
            if len(rest) >= 2 and rest[0] == "tree":
                return self._tree(handler, repo_id, rest[1], "/".join(rest[2:]), body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            return self._file(handler, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), body)
        self._send(handler, 404, b"", {"X-Error-Code": "RepoNotFound", "X-Error-Message": "not served"}, body)

    def _missing(self, handler, repo: Repo | None, body: bool) -> None:
        code = "RepoNotFound" if repo is None else "RevisionNotFound"
        self._send(handler, 404, b"", {"X-Error-Code": code, "X-Error-Message": f"{code} (hub stub)"}, body)

    def _info(self, handler, repo_id: str, revision: str, body: bool) -> None:
        repo, sha = self._commit(repo_id, revision)
        if sha is None:
            return self._missing(handler, repo, body)
        files = repo.commits[sha]
        data = {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "disabled": False,
                "gated": "manual" if repo.gated else False,
                "siblings": [{"rfilename": name} for name in files], "tags": []}
        self._json(handler, data, {"X-Repo-Commit": sha}, body)

    def _tree(self, handler, repo_id: str, revision: str, folder: str, body: bool) -> None:
        repo, sha = self._commit(repo_id, revision)
        if sha is None:
            return self._missing(handler, repo, body)
        if folder:  # the repositories are flat: no sub-folder exists (the hub says EntryNotFound)
            headers = {"X-Error-Code": "EntryNotFound", "X-Error-Message": f"{folder} does not exist (hub stub)"}
            return self._send(handler, 404, b"", headers, body)
        entries = []
        for name, blob in repo.commits[sha].items():
            entry = {"type": "file", "path": name, "size": len(blob.data), "oid": blob.git_sha1}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": blob.sha256, "size": len(blob.data), "pointerSize": 134}
            entries.append(entry)
        self._json(handler, entries, {}, body)

    def _file(self, handler, repo_id: str, revision: str, filename: str, body: bool) -> None:
        repo, sha = self._commit(repo_id, revision)
        if sha is None:
            return self._missing(handler, repo, body)
        blob = repo.commits[sha].get(filename)
        headers = {"X-Repo-Commit": sha}
        if blob is None:
            headers.update({"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found (hub stub)"})
            return self._send(handler, 404, b"", headers, body)
        if filename.endswith(LFS_SUFFIXES):
            etag = blob.sha256
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(blob.data))})
        else:
            etag = blob.git_sha1
        headers["ETag"] = f'"{etag}"'
        if self.redirect and filename.endswith(LFS_SUFFIXES):  # as the Hub: the bytes are on another origin
            headers["Location"] = f"{self.cdn_url}/blobs/{repo_id}/{sha}/{filename}?sig=stub"
            return self._send(handler, 302, b"", headers, body)
        self._bytes(handler, repo_id, filename, blob, headers, body)

    def _origin(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        """The other origin: `/blobs/{org}/{name}/{commit}/{filename}`, bytes and ranges, no commit header."""
        parts = [unquote(p) for p in urlsplit(handler.path).path.split("/")[1:]]
        if len(parts) >= 5 and parts[0] == "blobs":
            repo_id, sha, filename = f"{parts[1]}/{parts[2]}", parts[3], "/".join(parts[4:])
            repo = self.repos.get(repo_id)
            blob = repo.commits.get(sha, {}).get(filename) if repo is not None else None
            if blob is not None:
                return self._bytes(handler, repo_id, filename, blob, {"ETag": f'"{blob.sha256}"'}, body)
        self._send(handler, 404, b"", {}, body)

    def _bytes(self, handler, repo_id: str, filename: str, blob: Blob, headers: dict, body: bool) -> None:
        """A file's bytes, or the range asked (as `ranges` says)."""
        status, data, asked = 200, blob.data, handler.headers.get("Range") if body else None
        found = re.fullmatch(r"bytes=(\d+)-(\d*)", (asked or "").strip())
        if found is not None and self.ranges != "ignore":
            start, size = int(found[1]), len(blob.data)
            stop = min(size, int(found[2]) + 1) if found[2] else size
            if start >= size:
                headers["Content-Range"] = f"bytes */{size}"
                return self._send(handler, 416, b"", headers, body)
            if self.ranges == "stall" and stop > size // 2:
                self._closing.wait()
                return
            shift = 1 if self.ranges == "shifted" else 0
            status, data = 206, blob.data[start + shift : stop + shift]
            data = data[:-1] if self.ranges == "short" else data
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        if body:
            with self._lock:
                self.sent.append((f"/{repo_id}/{filename}", asked, len(data)))
        self._send(handler, status, data, headers, body, content_type="application/octet-stream")

    def _json(self, handler, data, headers: dict, body: bool) -> None:
        self._send(handler, 200, json.dumps(data).encode(), headers, body, content_type="application/json")

    def _send(self, handler, status: int, data: bytes, headers: dict, body: bool, content_type="text/plain") -> None:
        with self._lock:
            self.requests.append((handler.command, handler.path, status))
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)


# ------------------------------------------------------------ a link with latency and bandwidth (issue 71)


class Link:
    """A link's cost: `latency` seconds per round trip, `bandwidth` bytes per second shared by every answer (None:
    unlimited). Thread-safe; `connections`, `requests`: what came through it."""

    PIECE = 1 << 16  # bytes paced at a time: concurrent answers share the rate piece by piece

    def __init__(self, latency: float = 0.0, bandwidth: float | None = None):
        assert latency >= 0 and (bandwidth is None or bandwidth > 0), (latency, bandwidth)
        self.latency, self.bandwidth = float(latency), bandwidth
        self.connections = self.requests = 0
        self._lock = threading.Lock()
        self._free = 0.0  # when the shared link has sent everything reserved so far

    def round_trip(self, *, connection: bool = False) -> None:
        with self._lock:
            if connection:
                self.connections += 1
            else:
                self.requests += 1
        if self.latency:
            time.sleep(self.latency)

    def pace(self, size: int) -> None:
        """Wait until `size` more bytes have had their turn on the shared link."""
        if self.bandwidth is None or size <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._free = max(now, self._free) + size / self.bandwidth
            wait = self._free - now
        time.sleep(wait)


class _Paced:
    """A handler's `wfile` whose writes go out at the link's rate."""

    def __init__(self, raw, link: Link):
        self._raw, self._link = raw, link

    def write(self, data) -> int:
        view = memoryview(data)
        for start in range(0, len(view), Link.PIECE):
            piece = view[start : start + Link.PIECE]
            self._link.pace(len(piece))
            self._raw.write(piece)
        return len(view)

    def __getattr__(self, name):  # flush, close, closed: the socket's writer's
        return getattr(self._raw, name)


def shaped(handler: type[BaseHTTPRequestHandler], link: Link | None) -> type[BaseHTTPRequestHandler]:
    """`handler` behind `link` (itself when there is none): keep-alive, a round trip per connection and per
    request, answers paced."""
    if link is None:
        return handler

    class Shaped(handler):  # type: ignore[valid-type, misc]
        protocol_version = "HTTP/1.1"  # every answer has a Content-Length: connections stay open, as the Hub's

        def setup(self):
            super().setup()
            link.round_trip(connection=True)  # the connection's handshake
            self.wfile = _Paced(self.wfile, link)

        def parse_request(self):
            ok = super().parse_request()
            if ok:
                link.round_trip()  # the request's way there and its answer's way back
            return ok

    return Shaped


def unreachable_url() -> str:
    """A loopback URL nothing listens on: every request is refused at once."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{free.getsockname()[1]}"


def hub_env(url: str, home: Path, *, offline: bool = False) -> dict:
    """The environment of a process that may reach the stub only: no proxy, no token, no other HF_ setting."""
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY") and not k.startswith("HF_")}
    env.pop("TRANSFORMERS_OFFLINE", None)
    env.update(
        HF_ENDPOINT=url, HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"), HF_HUB_DISABLE_TELEMETRY="1",
        NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
        MERGEKIT_RAM_CACHE="off", MERGEKIT_RAM_NATIVE="0",  # no statistics cache, no kernel build on the way
    )
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env
