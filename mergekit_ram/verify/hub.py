"""`mergekit-ram verify ORG/NAME[@REVISION]`: a merge published on the Hugging Face Hub, fetched for verify.

Only the files verify reads or names are fetched, into the Hub cache, at the commit the revision names when
asked (the verdict records it): `ram_stats.json`, `mergekit_config.yml`, the card, the config, the files beside
the weights a loader reads (tokenizer, generation config, a PEFT adapter, named chat templates) and the weight
files each loader reads (a single file, an index and every shard it names). Never code: a `.py` file on the
Hub is named from the repository's listing, unfetched, and so is every other file no loader reads. verify
then reads the snapshot folder as any folder (`folder_checks.homes` accepts its links into the cache's blobs).
The Hub offline (`HF_HUB_OFFLINE`), unreachable, or without the repository or revision: `Unreadable` in
one line (verify's exit 3); a repository without `ram_stats.json`: `NotVerifiable` (exit 2, as for a folder).

Nothing the Hub says is believed unchecked (`guarded`: huggingface_hub's own client, its transport wrapped):
every commit id it answers with (`X-Repo-Commit`, a JSON `sha`) must be 40 lowercase hex digits before it
reaches a path or a revision (`_commit`), a request that names a commit must be answered by that commit and
every file by the commit the verdict names (`_Answers.check`); every connect and every read is bounded in time
(`bounds`: huggingface_hub's `HF_HUB_ETAG_TIMEOUT` and `HF_HUB_DOWNLOAD_TIMEOUT`); answers that disagree (a
file the listing names that the tree or the downloads do not give) are `Unreadable`, never a usage error.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mergekit_ram import errors
from mergekit_ram.checks import output_checks
from mergekit_ram.errors import NotVerifiable, Unreadable
from mergekit_ram.verify import folder_checks, loader_files

#: what verify reads beside the weights, by name (the weights: `loader_files.SINGLE`, `PICKLED` and their indexes)
CONFIG_FILE = "mergekit_config.yml"
RECORDS = (output_checks.STATS_FILE, CONFIG_FILE, "README.md", "config.json")
#: a commit id as the Hub names one (huggingface_hub's own `REGEX_COMMIT_HASH`)
COMMIT = re.compile(r"[0-9a-f]{40}")
#: a request that names a commit: a file at it, the repository at it, its tree at it
_PINNED = re.compile(r"/(?:resolve|revision|tree)/([0-9a-f]{40})(?:/|$)")
#: a revision the user may ask for: a branch, a tag or a commit (git's own rules, less what names a path)
REVISION = re.compile(r"(?!.*\.\.)(?!/)[\w.\-/]+(?<!/)")


@dataclass(frozen=True)
class Published:
    """A published merge fetched from the Hub: `folder` (the Hub cache's snapshot), at `revision` (the commit),
    asked for as `requested`; `not_fetched`: the repository's other files, named from its listing; `fetched`: the
    files fetched; `weights`: the weight files verify reads, left on the Hub (`fetch(weights=False)`: `ranged`)."""

    repository: str
    requested: str
    revision: str
    folder: str
    not_fetched: tuple[str, ...] = ()
    fetched: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()

    def as_json(self) -> dict:
        return {"repository": self.repository, "requested": self.requested, "revision": self.revision}

    def unfetched(self, trusted: bool) -> tuple[list[str], list[str], list[str]]:
        """What the verdict says of the files verify did not fetch: (differences, why it cannot check, not
        checked). Code is not the merge's, or, where the merge ran with trust_remote_code (`trusted`) and so wrote
        its donor's config module, cannot be checked: verify fetches no code. The rest no loader reads."""
        code = [name for name in self.not_fetched if loader_files.is_code(name)]
        rest = [name for name in self.not_fetched if not loader_files.is_code(name)]
        said = f"{folder_checks.listed(code, 3)}: Python code on the Hub (not fetched), which transformers runs"
        files, blocked, unread = [], [], []
        if code and trusted:
            blocked.append(f"{said}; the merge ran with trust_remote_code, so wrote its donor's: verify a download")
        elif code:
            files.append(f"{said} with trust_remote_code; the merge writes no such file")
        if rest:
            unread.append(f"{folder_checks.listed(rest, 10)} (on the Hub, not fetched: no loader reads them)")
        return files, blocked, unread


def parse(target: str) -> tuple[str, str] | None:
    """(repository, revision) when `target` is a Hub model id `org/name[@revision]` that is no local path (a
    folder of that name wins, as mergekit resolves inputs); None for a folder."""
    if os.path.lexists(target):
        return None
    repository, _, revision = target.partition("@")
    if repository.count("/") != 1 or (target.count("@") and not revision.strip()):
        return None
    from huggingface_hub.utils import validate_repo_id  # the Hub's own rule, as input_checks asks it

    try:
        validate_repo_id(repository)
    except ValueError:
        return None
    return repository, revision or "main"


def wanted(name: str) -> bool:
    """Whether verify reads a file of this name from the top of a published folder (a shard at any depth is
    fetched when an index names it)."""
    if loader_files.is_code(name):
        return False
    single = (*loader_files.SINGLE, *loader_files.PICKLED)
    named = (*RECORDS, *loader_files.COPIED, *loader_files.ADAPTER, *single, *(s + ".index.json" for s in single))
    chat = name.startswith(loader_files.CHAT_TEMPLATES + "/") and name.endswith(".jinja") and name.count("/") == 1
    return name in named or chat


def fetch(
    repository: str, requested: str, *, cache_dir: str | None = None, quiet: bool = False, weights: bool = True
) -> Published:
    """The files verify reads of `repository` at `requested`, downloaded into the Hub cache (`cache_dir`, else
    huggingface_hub's); without `weights`, the weight files are named, left for ranged reads (`verify --sample`).
    Unreadable, in one line, when the Hub cannot say or give them, or its answers disagree."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    said = f"{repository}@{requested}"
    if not REVISION.fullmatch(requested):
        raise NotVerifiable(f"{said}: not a revision (a branch, a tag or a commit)")
    if constants.HF_HUB_OFFLINE:
        raise Unreadable(
            f"{said}: HF_HUB_OFFLINE is set, so the Hub is not asked for its files; verify a downloaded copy "
            "instead (mergekit-ram verify FOLDER)"
        )
    shown = are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        with guarded() as answers:
            info = HfApi().model_info(repository, revision=requested, timeout=bounds()[0])
            commit = answers.commit = _commit(info.sha, "its metadata")
            if COMMIT.fullmatch(requested) and commit != requested:
                raise _Lie(f"the Hub answered with commit {commit}, not the commit {requested} asked for")
            listed = sorted(s.rfilename for s in info.siblings or [])
            if output_checks.STATS_FILE not in listed and CONFIG_FILE not in listed:  # as a folder without both
                raise Unreadable(
                    f"{said} (commit {commit}) holds neither {output_checks.STATS_FILE} nor {CONFIG_FILE}, so "
                    "nothing says what was merged (a merge written with --no-write-model-card, or not a merge)"
                )
            left = [name for name in listed if wanted(name) and not weights and _weight(name)]
            first = [name for name in listed if wanted(name) and name not in left]
            folder = download(repository, commit, first, cache_dir)
            shards = {
                name
                for choice in loader_files.loader_choices(folder).values()
                if choice.endswith(".index.json")
                for name in loader_files.weight_files(folder, choice)
            }
            more = sorted(shards & set(listed) - set(first) - {n for n in shards if loader_files.is_code(n)})
            left, more = (left, more) if weights else (sorted({*left, *more}), [])
            if more:
                download(repository, commit, more, cache_dir)
    except _Lie as error:
        raise Unreadable(f"{said}: {error}") from error
    except (Unreadable, NotVerifiable):
        raise
    except Exception as error:
        raise Unreadable(_why(said, error, constants.ENDPOINT)) from error
    finally:
        if quiet and not shown:
            enable_progress_bars()
    fetched = {*first, *more}
    unfetched = tuple(n for n in listed if n not in fetched and n not in left)
    return Published(repository, requested, commit, folder, unfetched, tuple(sorted(fetched)), tuple(left))


def _weight(name: str) -> bool:
    """A weight file (not an index), which `verify --sample` reads by ranges."""
    return name.endswith((".safetensors", ".bin"))


def _commit(said: Any, where: str) -> str:
    """`said`, a commit id from the Hub, when it is one (40 lowercase hex digits); Unreadable otherwise: it would
    name a path in the Hub cache, or a revision."""
    if isinstance(said, str) and COMMIT.fullmatch(said):
        return said
    raise _Lie(f"{where}: the Hub answered with {str(said)[:80]!r} as a commit id, not 40 hex digits")


class _Lie(Unreadable):
    """An answer of the Hub that contradicts itself or what was asked (said without the repository)."""


def bounds() -> tuple[float, float]:
    """(metadata, download): in seconds, how long verify waits for a connection and each read of the repository's
    metadata or a file's headers (huggingface_hub's `HF_HUB_ETAG_TIMEOUT`), and for each read of a listing or a
    file's bytes (`HF_HUB_DOWNLOAD_TIMEOUT`): 10 s each unless set. huggingface_hub retries a listing or a download
    that timed out up to 5 times (docs/verify.md: about 85 s per request at the defaults)."""
    from huggingface_hub import constants

    return float(constants.HF_HUB_ETAG_TIMEOUT), float(constants.HF_HUB_DOWNLOAD_TIMEOUT)


class _Answers:
    """huggingface_hub's HTTP transport, wrapped: every request bounded in time (`bounds`, where it set none),
    every answer's commit checked (`check`) before huggingface_hub reads it: the one place that does."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.commit: str | None = None  # the commit the verdict names, once known: every file comes from it

    def handle_request(self, request: Any) -> Any:
        metadata, download = bounds()
        asked = dict(request.extensions.get("timeout") or {})
        wanted = {"connect": metadata, "read": download, "write": download, "pool": metadata}
        request.extensions = {**request.extensions, "timeout": {k: asked.get(k) or v for k, v in wanted.items()}}
        response = self.inner.handle_request(request)
        try:
            self.check(str(request.url.path), response)
        except BaseException:
            response.close()
            raise
        return response

    def check(self, path: str, response: Any) -> None:
        """The commit an answer names (its `X-Repo-Commit`, and a repository answer's `sha`): 40 hex digits, the
        commit the request named if it named one, and the verdict's commit for every file."""
        said = [response.headers.get("X-Repo-Commit")]
        if path.startswith("/api/models/") and "/tree/" not in path and response.status_code == 200:
            response.read()  # a repository's metadata: small, and read within the bounds
            with contextlib.suppress(ValueError, AttributeError):
                said.append(json.loads(response.content).get("sha"))
        pinned = _PINNED.search(path)
        for commit in [_commit(c, f"the answer to {path}") for c in said if c is not None]:
            if pinned and commit != pinned.group(1):
                raise _Lie(f"the Hub answered {path} with commit {commit}, not the commit {pinned.group(1)} it names")
            if self.commit and "/resolve/" in path and commit != self.commit:
                raise _Lie(f"the Hub answered {path} with commit {commit}, not the commit {self.commit} verified")

    def close(self) -> None:
        self.inner.close()


@contextlib.contextmanager
def guarded() -> Iterator[_Answers]:
    """While inside, huggingface_hub's requests go through `_Answers`: its client factory set (the session there
    was closed: the next request makes one), then its default again."""
    from huggingface_hub.utils import _http, set_client_factory

    answers = _Answers(None)

    def client() -> Any:
        session = _http.default_client_factory()
        answers.inner = _kept_open(session._transport)
        session._transport = answers  # type: ignore[assignment]  # a transport by duck typing: handle_request, close
        return session

    set_client_factory(client)
    try:
        yield answers
    finally:
        set_client_factory(_http.default_client_factory)


#: connections the client keeps open for reuse (its default keeps 20): `verify --sample` has up to
#: `ranged.PARALLEL` ranged reads in flight, and a connection opened again costs a handshake (TCP and TLS: two or
#: three round trips) on every request beyond the 20
KEEP_OPEN = 64


def _kept_open(transport: Any) -> Any:
    """huggingface_hub's default transport made again with `KEEP_OPEN` connections kept open, its other settings
    the default's (httpx's or httpx2's `HTTPTransport`, whichever huggingface_hub uses); as it was if it cannot be."""
    import importlib

    try:
        package = importlib.import_module(type(transport).__module__.split(".")[0])
        limits = package.Limits(max_connections=max(100, KEEP_OPEN), max_keepalive_connections=KEEP_OPEN)
        pooled = type(transport)(limits=limits)
    except Exception:  # another transport than the default's: kept as huggingface_hub made it
        return transport
    transport.close()
    return pooled


def download(repository: str, commit: str, names: list[str], cache_dir: str | None) -> str:
    """`names` of `repository` at `commit`, each matched exactly (glob characters escaped); the snapshot folder,
    which must be that commit's and hold every name (Unreadable otherwise)."""
    import glob

    from huggingface_hub import snapshot_download

    patterns = [glob.escape(name) for name in names]
    folder = str(
        snapshot_download(
            repository, revision=commit, allow_patterns=patterns, cache_dir=cache_dir, etag_timeout=bounds()[0]
        )
    )
    if os.path.basename(folder) != commit:
        raise _Lie(f"huggingface_hub gave the files of commit {os.path.basename(folder)}, not of commit {commit}")
    missing = [name for name in names if not os.path.isfile(os.path.join(folder, name))]
    if missing:  # its listing named them, its tree or its file answers did not give them
        raise _Lie(
            f"the Hub's answers disagree: its listing of commit {commit} names {folder_checks.listed(missing, 3)}, "
            "which its tree or its file answers then did not give"
        )
    return folder


def _why(said: str, error: Exception, endpoint: str) -> str:
    """One line: why the Hub gave no files."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(error, GatedRepoError):
        return f"{said}: a gated repository on {endpoint}: ask for access on its page and log in (`hf auth login`)"
    if isinstance(error, RepositoryNotFoundError):
        return f"{said}: no such model repository on {endpoint} (a private one needs `hf auth login`)"
    if isinstance(error, RevisionNotFoundError):
        return f"{said}: the repository on {endpoint} has no revision {said.partition('@')[2]}"
    return f"{said}: the Hub at {endpoint} could not be asked ({errors.said_with_type(error)})"


def quiet_bars(quiet: bool) -> Callable[[], None]:
    """With `quiet` (`verify -q`, `--json`), huggingface_hub's progress bars off until the returned function is
    called (which puts them back as they were); without it, nothing changes."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if not quiet or are_progress_bars_disabled():
        return lambda: None
    disable_progress_bars()
    return enable_progress_bars
