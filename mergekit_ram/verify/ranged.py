"""`verify --sample` from the Hub: files read by HTTP ranges into sparse local stand-ins, never downloaded whole.

A `Mirror` holds, in a private temporary folder, a stand-in of each Hub repository a sample reads (the published
merge, and each input recorded as a hub id at its recorded commit): its small files whole (fetched into the Hub
cache as any verify fetches them), each safetensors weight file as a sparse file of its true size holding only
the ranges read so far: its header and the sixteen windows an input's identity samples (`cache.sample_offsets`)
when made, then the slices' bytes (`fill`, after the draw). verify reads the stand-ins as any folder; a
range never read holds zeros, and nothing reads one. A pickled weight file (`.bin`) has no header to range over: it
is read whole, and the verdict says so.

Reads go through huggingface_hub's own means (`hf_hub_url`, its session and headers, `hf_raise_for_status`); a
file the Hub redirects (to its CDN, as it does for weight files) is asked at the place it redirected to after the
first read (again at the Hub's URL if that place refuses: a signed link that expired). Near ranges of a file are
joined (`GAP`) and `PARALLEL` requests run at once. Each answer is checked: a 206 must say it holds exactly the
bytes asked (`Content-Range`) and hold that many; a server that ignores ranges (200, the whole file) is read whole,
once: the stand-in then holds the file, nothing more is asked of it, and it is noted once (`more_than_needed`);
anything else is `Unreadable` naming the file (verify's exit 3), and so is a read that stalls past huggingface_hub's
`HF_HUB_DOWNLOAD_TIMEOUT`. `received` counts the bytes that came.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import os
import re
import shutil
import threading
from collections.abc import Iterable, Mapping

from mergekit_ram import errors, files
from mergekit_ram.core import cache
from mergekit_ram.errors import Unreadable
from mergekit_ram.verify import hub, sample

#: what mergekit fetches of a hub input (`ModelReference.local_path`, 0.1.5): these, and its weights
INPUT_PATTERNS = ("tokenizer.model", "*.json")
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
#: bytes asked for at most in one request (near ranges are joined up to this)
JOIN = 1 << 26
#: ranges of a file at most this many bytes apart are asked for in one request
GAP = 1 << 12
#: requests in flight at once
PARALLEL = 32


class Reader:
    """Ranged reads of files of Hub repositories at a commit; `received`: the bytes that came, `more_than_needed`:
    one line per file a server sent whole instead of a range; `endpoint`: another Hub than `HF_ENDPOINT`'s. Reads
    may run in threads (`Mirror.fill_all`)."""

    def __init__(self, endpoint: str | None = None) -> None:
        self.endpoint = endpoint
        self.received = 0
        self.requests = 0  # ranged reads asked (a redirect followed counts once): what `--sample` reports
        self.more_than_needed: list[str] = []
        self.located: dict[str, str] = {}
        self._lock = threading.Lock()
        self._urls: dict[tuple[str, str, str], str] = {}
        self._headers: dict[str, str] | None = None

    def count(self, size: int) -> None:
        with self._lock:
            self.received += size

    def _asked(self, repository: str, commit: str, name: str) -> tuple[str, dict[str, str]]:
        """The file's Hub URL and the request headers, made once per file and per reader: thousands of ranges
        each paid for both (the token looked up, the URL quoted) on CPUs that the recompute shares."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        with self._lock:
            url = self._urls.get((repository, commit, name))
            if url is None:
                url = self._urls[repository, commit, name] = hf_hub_url(
                    repository, name, revision=commit, endpoint=self.endpoint
                )
            if self._headers is None:
                self._headers = {**build_hf_headers(), "Accept-Encoding": "identity"}
            self.requests += 1
            return url, self._headers

    def read(self, repository: str, commit: str, name: str, start: int, stop: int) -> tuple[bytes, int]:
        """Bytes [start, stop) of `name` and the file's size; from a server that ignores ranges (HTTP 200), the
        whole file instead (then len(bytes) is the size, and the file is noted once)."""
        from huggingface_hub.utils import get_session, hf_raise_for_status

        said = f"{repository}@{commit}/{name}"
        url, common = self._asked(repository, commit, name)
        headers = {**common, "Range": f"bytes={start}-{stop - 1}"}
        located = self.located.get(url)  # where the Hub redirected this file before: asked there directly
        try:
            with get_session().stream("GET", located or url, headers=headers, follow_redirects=True) as response:
                if located is not None and response.status_code in (401, 403, 404, 410):  # a link that expired
                    self.located.pop(url, None)
                    return self.read(repository, commit, name, start, stop)
                hf_raise_for_status(response)
                if located is None and str(response.url) != url:
                    with self._lock:
                        self.located[url] = str(response.url)
                if response.status_code == 206:
                    size = _partial(said, response.headers.get("Content-Range"), start, stop)
                    data = _take(response, stop - start, self)
                elif response.status_code == 200:  # the whole file: kept whole, so it is read once
                    size = int(response.headers.get("Content-Length") or -1)
                    data = _take(response, max(size, stop), self)
                    if len(data) != size:
                        raise Unreadable(f"{said}: the server said {size} byte(s) and sent {len(data)}")
                    with self._lock:
                        self.more_than_needed.append(f"{said}: the server ignored a range and sent the whole file")
                    return data, size
                else:
                    raise Unreadable(f"{said}: the server answered a range read with HTTP {response.status_code}")
        except Unreadable:
            raise
        except Exception as error:
            raise Unreadable(f"{said}: cannot be read from the Hub ({errors.said_with_type(error)})") from error
        if len(data) != stop - start:
            raise Unreadable(f"{said}: asked for bytes {start}-{stop - 1}, the server sent {len(data)} byte(s)")
        return data, size


def _partial(said: str, header: str | None, start: int, stop: int) -> int:
    """The file's size from a 206's Content-Range, which must name exactly the bytes asked."""
    found = _RANGE.fullmatch((header or "").strip())
    if found is None or (int(found[1]), int(found[2]) + 1) != (start, stop) or found[3] == "*":
        raise Unreadable(f"{said}: asked for bytes {start}-{stop - 1}, the server answered {header!r}")
    return int(found[3])


def _take(response: object, count: int, reader: Reader) -> bytes:
    """At most `count` bytes of a streamed body: read to its end when it holds no more (so the connection is kept
    for the next request: a body left unread closes it), the rest left unread when the server sends more."""
    out = bytearray()
    for chunk in response.iter_bytes():  # type: ignore[attr-defined]
        reader.count(len(chunk))
        room = count - len(out)
        out += chunk[:room]
        if len(chunk) > room:
            break  # the server sends more than asked: the rest is not read
    return bytes(out)


class Mirror:
    """Sparse local stand-ins of Hub repositories under `root` (see the module's docstring)."""

    def __init__(self, root: str, reader: Reader | None = None) -> None:
        self.root = root
        self.reader = reader or Reader()
        #: a stand-in weight file (its real path) -> (repository, commit, name in it); and the ranges it holds
        self.remote: dict[str, tuple[str, str, str]] = {}
        self.held: dict[str, list[tuple[int, int]]] = {}
        self.whole: set[str] = set()  # stand-ins a server sent whole: nothing more is asked of them
        self._lock = threading.Lock()

    def folder(self, repository: str, commit: str) -> str:
        """The stand-in's folder (`.../snapshots/COMMIT`, so an identity records the commit as a snapshot's does)."""
        path = os.path.join(self.root, repository.replace("/", "--"), "snapshots", commit)
        os.makedirs(path, exist_ok=True)
        return path

    def copy(self, source: str, folder: str, names: Iterable[str]) -> None:
        """Small files fetched whole (`source`: a Hub cache snapshot) copied into a stand-in."""
        for name in names:
            target = os.path.join(folder, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(source, name), target)

    def weight(self, repository: str, commit: str, folder: str, name: str, *, identity: bool = False) -> None:
        """A weight file's stand-in: its header (and with `identity`, the windows an identity samples); a pickle
        whole. A server that ignores ranges gives the whole file at the first read: nothing more is asked of it."""
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.remote[os.path.realpath(path)] = (repository, commit, name)
        first, size = self.reader.read(repository, commit, name, 0, 8)
        with open(path, "wb") as f:
            f.truncate(size)
        self._write(path, 0, first)
        if len(first) == size != 8:  # a server that ignores ranges sent it whole
            self.whole.add(os.path.realpath(path))
        if not name.endswith(".safetensors"):
            self.fill(path, [(8, size)])
            return
        length = int.from_bytes(first[:8], "little")
        if length > files.MAX_HEADER or 8 + length > size:
            raise Unreadable(f"{repository}@{commit}/{name}: implausible safetensors header size {length}")
        self.fill(path, [(8, 8 + length)])
        if identity:
            self.fill(path, [(start, min(size, start + cache.SAMPLE)) for start in cache.sample_offsets(size)])

    def fill(self, path: str, spans: Iterable[tuple[int, int]]) -> None:
        """Fetch the spans of a stand-in it does not hold yet (near ones joined)."""
        self.fill_all({path: spans})

    def fill_all(self, needed: Mapping[str, Iterable[tuple[int, int]]]) -> None:
        """Fetch what `needed` (file -> spans) names of the stand-ins (other files are local), near spans of a file
        joined, `PARALLEL` requests at a time; the first failure stops the rest (Unreadable, naming the file)."""
        asked = []
        for path, spans in needed.items():
            path = os.path.realpath(path)
            if path in self.remote:
                asked += [
                    (path, start, stop) for start, stop in _joined(_missing(sorted(spans), self.held.get(path, [])))
                ]
        if not asked:
            return
        if len(asked) == 1:
            self._fetch(*asked[0])
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL) as pool:
            running = [pool.submit(self._fetch, *job) for job in asked]
            try:
                for done in concurrent.futures.as_completed(running):
                    done.result()
            except BaseException:
                for future in running:
                    future.cancel()
                raise

    def _fetch(self, path: str, start: int, stop: int) -> None:
        with self._lock:  # a set, not the held spans: thousands of ranges of one file each looked through them all
            if path in self.whole:
                return  # a server that sent the whole file already gave it
        repository, commit, name = self.remote[path]
        data, size = self.reader.read(repository, commit, name, start, stop)
        if len(data) == size and (start, stop) != (0, size):  # the whole file (a server that ignores ranges)
            self._write(path, 0, data)
            with self._lock:
                self.whole.add(path)
        else:
            self._write(path, start, data)

    def _write(self, path: str, start: int, data: bytes) -> None:
        with open(path, "r+b") as f:
            f.seek(start)
            f.write(data)
        with self._lock:
            self.held.setdefault(os.path.realpath(path), []).append((start, start + len(data)))


def _missing(spans: list[tuple[int, int]], held: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `spans` (sorted) not inside `held`."""
    out = []
    for start, stop in spans:
        for a, b in sorted(held):
            if a <= start < b:
                start = b
        if start < stop and not any(a <= start and stop <= b for a, b in held):
            out.append((start, stop))
    return out


def _joined(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans at most `GAP` bytes apart joined (up to `JOIN` bytes each): a request costs more than a few KiB."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if out and start <= out[-1][1] + GAP and stop - out[-1][0] <= JOIN:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def account(drawn: sample.Sample, spans: Mapping[str, Iterable[tuple[int, int]]], mirror: Mirror | None) -> None:
    """What a sample read, into `drawn`: the bytes of weight files (`spans`' local ones, each byte once, and what
    came from the Hub), the requests made, why more than needed came, and the bytes a full verify reads (every
    weight file whole: a stand-in has its file's true size)."""
    remote = mirror.remote if mirror is not None else {}
    drawn.bytes_read = sample.bytes_read({path: set(found) for path, found in spans.items()}, remote)
    drawn.full_bytes = sum(os.path.getsize(path) for path in spans)
    if mirror is not None:
        drawn.bytes_read += mirror.reader.received
        drawn.requests = mirror.reader.requests
        drawn.more_than_needed += mirror.reader.more_than_needed


def input_names(listed: Iterable[str]) -> tuple[list[str], list[str]]:
    """(small files, weight files) mergekit fetches of a hub input with these files (`INPUT_PATTERNS`; safetensors
    where there are any, else `.bin`)."""
    listed = list(listed)
    weights = "*.safetensors" if any(n.lower().endswith(".safetensors") for n in listed) else "*.bin"
    small = [n for n in listed if any(fnmatch.fnmatch(n, p) for p in INPUT_PATTERNS)]
    return small, [n for n in listed if fnmatch.fnmatch(n, weights) and n not in small]


def published_stand_in(mirror: Mirror, published: hub.Published) -> str:
    """The stand-in of a merge fetched without its weights (`hub.fetch(weights=False)`): its files, and each weight
    file's header."""
    folder = mirror.folder(published.repository, published.revision)
    mirror.copy(published.folder, folder, published.fetched)
    for name in published.weights:
        mirror.weight(published.repository, published.revision, folder, name)
    return folder


def input_stand_ins(
    mirror: Mirror, inputs: Iterable[tuple[str, dict]], copies: Mapping[str, str], cache_dir: str | None
) -> dict[str, str]:
    """input (as recorded) -> its stand-in, for each input recorded as a hub id at a commit (`inputs`: (name,
    recorded identity)) that has no local copy: its small files fetched into the Hub cache as mergekit fetches
    them, its weight files' headers and identity windows by ranges. Unreadable, naming the input, when the Hub
    cannot list or give them."""
    from huggingface_hub import HfApi

    out = {}
    for model, identity in inputs:
        commit = identity.get("revision")
        if model in copies or not commit or os.path.exists(model) or "+" in model:
            continue  # a local folder, a copy, a LoRA (mergekit merges it first), or no recorded commit
        repository = model.partition("@")[0]
        try:
            listed = [s.rfilename for s in HfApi().model_info(repository, revision=commit).siblings or []]
            small, weights = input_names(listed)
            folder = mirror.folder(repository, commit)
            if small:  # as the merge's own files: the snapshot's commit and every name checked
                mirror.copy(hub.download(repository, commit, small, cache_dir), folder, small)
        except Exception as error:
            said = f"input {model}: the Hub cannot give it at {commit} ({errors.said_with_type(error)})"
            raise Unreadable(said) from error
        for name in weights:
            mirror.weight(repository, commit, folder, name, identity=True)
        out[model] = folder
    return out
