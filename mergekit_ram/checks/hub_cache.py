"""A hub id read from the Hugging Face Hub cache when the Hub cannot be asked (`HF_HUB_OFFLINE`, or unreachable).

mergekit 0.1.5 lists a hub id's files on the Hub before it looks in the cache, so offline no hub id merged, even one
transformers loads from the cache. A `ramplus` merge reads each such input where the cache holds it at the revision
asked, as transformers does: `models--org--name/snapshots/<commit>`, the commit a branch's `refs/<branch>` names, or
the commit given. The snapshot folder's name is the commit, so the merge records the same revision as online.

What the cache cannot give is one line naming the id, the revision and the cache folder: a repository not there, a
revision it does not hold (never another commit's weights), a `refs/` entry naming a commit whose snapshot is missing
or incomplete (no config.json, a weight file or shard missing, a link whose blob is gone).
"""

from __future__ import annotations

import json
import os
import re

from mergekit_ram.errors import RamError

#: a full commit id: a revision read as a commit, not as a `refs/` entry
COMMIT = re.compile(r"[0-9a-f]{40}")
#: a model's weights as mergekit finds them in a folder: the first of these that is there
WEIGHTS = (
    ("model.safetensors.index.json", True),
    ("model.safetensors", False),
    ("pytorch_model.bin.index.json", True),
    ("pytorch_model.bin", False),
)


def repository_folder(repo: str, cache_dir: str | None) -> str:
    """The Hub cache's folder of model `repo` (`cache_dir`: mergekit's `--transformers-cache`; else HF_HUB_CACHE)."""
    from huggingface_hub import constants

    return os.path.join(cache_dir or constants.HF_HUB_CACHE, "models--" + repo.replace("/", "--"))


def cached(repo: str, cache_dir: str | None) -> bool:
    """Whether the Hub cache holds anything of model `repo`."""
    return os.path.isdir(repository_folder(repo, cache_dir))


def snapshot(named: str, repo: str, revision: str | None, cache_dir: str | None, why: str) -> str:
    """The complete snapshot folder of model `repo` at `revision` (None: main) in the Hub cache; RamError, one line
    beginning with `named` (what the input is called) and ending with `why` (why the cache is read), otherwise."""
    folder = repository_folder(repo, cache_dir)
    asked = revision or "main"
    ref = os.path.join(folder, "refs", asked)
    if COMMIT.fullmatch(asked):
        commit = asked
    elif os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
    else:
        raise RamError(f"{named}: the Hub cache {folder} has no refs/{asked}; it holds {_held(folder)} ({why})")
    found = os.path.join(folder, "snapshots", commit)
    if not os.path.isdir(found):
        if commit == asked:
            raise RamError(
                f"{named}: the Hub cache {folder} holds {_held(folder)}, not commit {asked}; another commit's weights "
                f"are not read ({why})"
            )
        raise RamError(
            f"{named}: refs/{asked} in the Hub cache {folder} names commit {commit}, whose snapshot folder is missing "
            f"(a download removed or interrupted?) ({why})"
        )
    lacks = incomplete(found)
    if lacks:
        raise RamError(
            f"{named}: the Hub cache's snapshot {found} ({asked}) is incomplete: {lacks} (an interrupted download?) "
            f"({why})"
        )
    return found


def incomplete(folder: str) -> str:
    """What a snapshot folder lacks for a merge ('' when nothing): config.json, its weights (every shard an index
    names), or the blob a file links to."""
    gone = sorted(n for n in os.listdir(folder) if os.path.islink(os.path.join(folder, n)) and not _there(folder, n))
    if gone:
        return f"{', '.join(gone)} link(s) to a blob that is not there"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return "no config.json"
    for name, index in WEIGHTS:
        if not os.path.isfile(os.path.join(folder, name)):
            continue
        shards = _shards(os.path.join(folder, name)) if index else []
        missing = [shard for shard in shards if not os.path.isfile(os.path.join(folder, shard))]
        return f"{name} names missing shard(s) {', '.join(missing)}" if missing else ""
    return "no weight file (model.safetensors, an index and its shards, or pytorch_model.bin)"


def _shards(index: str) -> list[str]:
    """The files an index's `weight_map` names (none when it cannot be read: mergekit's loader says why)."""
    try:
        with open(index, encoding="utf-8") as f:
            return sorted({str(name) for name in json.load(f)["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _there(folder: str, name: str) -> bool:
    return os.path.exists(os.path.join(folder, name))


def _held(folder: str) -> str:
    """The commits a repository's cache folder holds a snapshot of, each with the refs/ entries naming it."""
    try:
        commits = sorted(os.listdir(os.path.join(folder, "snapshots")))
    except OSError:
        commits = []
    if not commits:
        return "no snapshot"
    refs: dict[str, list[str]] = {}
    for root, _, names in os.walk(os.path.join(folder, "refs")):
        for name in names:
            path = os.path.join(root, name)
            try:
                with open(path, encoding="utf-8") as f:
                    refs.setdefault(f.read().strip(), []).append(os.path.relpath(path, folder))
            except OSError:
                continue
    shown = [commit + (f" ({', '.join(sorted(refs[commit]))})" if commit in refs else "") for commit in commits]
    return f"commit{'s' if len(commits) > 1 else ''} {', '.join(shown)}"
