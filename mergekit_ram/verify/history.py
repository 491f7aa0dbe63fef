"""Inputs without a record: the commit of an unpinned Hub input that a published merge was made from.

A folder with only mergekit's `mergekit_config.yml` names its inputs as the config wrote them: `org/name`
without `@revision` says nothing of the commit the merge read. The merge was published at a time T, its
repository's commit's date (`published_time`); the input's commits up to T are the candidates, newest first,
one per set of weights (`candidates`: a commit that changed only the card or the tokenizer collapses into the
newest commit with the same weights, which gives the same merge); the driver recomputes the merge from them,
newest combination first, within a bound (`choose`), and takes the first that reproduces it. The verdict names,
for every input, the commit read and how it was found: `PINNED`, `GIVEN`, `inferred(T)`, `HEAD`, `LOCAL`.

An input that cannot be looked back at (deleted or private, gated, renamed, its history before T squashed
away, its branch gone, the Hub not answering) is `InputUnavailable` naming it: an `Unreadable`, so verify's
"cannot check" (exit 3), never a difference; the merged repository's own history unreadable is `Unreadable`.

Knows nothing of mergekit. The Hub is asked through huggingface_hub's own client, guarded as `hub` guards it
(`hub.guarded`: every commit id an answer names checked, every request bounded in time), and every commit id
the history names must be one (`hub.COMMIT`) before it becomes a revision.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from mergekit_ram import errors
from mergekit_ram.errors import InputUnavailable, Unreadable
from mergekit_ram.verify import hub

#: how the commit of each input was found, as the verdict says it
PINNED = "pinned in the config"
GIVEN = "given (--input)"
INFERRED = "inferred from its history at {at}"  # `inferred(T)` fills it
HEAD = "head of its branch today"
LOCAL = "a local folder, read as it is now"

#: the files whose hashes tell one commit's weights from another's (mergekit reads the top of a model's folder)
WEIGHT_SUFFIXES = (".safetensors", ".bin")
#: how many combinations of candidate commits `choose` recomputes at most, unless told
ATTEMPTS = 16


def iso(at: datetime) -> str:
    """`at` in UTC, to the second, as ISO 8601 with a `Z` (how the verdict writes T)."""
    return at.astimezone(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def inferred(at: datetime) -> str:
    """The `how` of an input whose commit was found in its history at `at` (T)."""
    return INFERRED.format(at=iso(at))


@dataclass(frozen=True)
class Candidate:
    """A commit of an input that may be the one a merge read: `commit` (40 hex digits), its `date` (aware, UTC),
    `weights_hash` (one sha256 over its weight files' names and LFS sha256: equal for commits with the same
    weights), and `how` it was found (`inferred(T)`)."""

    commit: str
    date: datetime
    weights_hash: str
    how: str


def published_time(repo: str, commit: str) -> datetime:
    """T: the date (aware, UTC) of `commit` of the merged repository `repo`, from its history on the Hub. A merge
    whose card was edited after its weights were uploaded has the edit's date: a later T costs attempts (inputs
    updated in between come first), never a wrong answer (a candidate is taken only when it reproduces the merge).
    Unreadable naming `repo` when its history cannot be read or does not begin at `commit`."""
    if not hub.COMMIT.fullmatch(commit):
        raise ValueError(f"{repo}: {commit!r} is not a commit id (40 hex digits)")
    said = f"{repo}@{commit}"
    from huggingface_hub import HfApi

    try:
        with hub.guarded():
            history = HfApi().list_repo_commits(repo, revision=commit)
    except Exception as error:
        raise _failed(said, error, None) from error
    if not history or history[0].commit_id != commit:
        first = history[0].commit_id if history else "nothing"
        raise Unreadable(f"{said}: the Hub's history of this commit begins at {first}, not at the commit itself")
    return _utc(history[0].created_at, said)


def candidates(repo_id: str, branch: str, before: datetime, *, limit: int | None = None) -> list[Candidate]:
    """The commits of the input `repo_id` on `branch` dated at or before `before` (T, aware), newest first, one per
    set of weights: a commit whose weight files (`WEIGHT_SUFFIXES` at the top of its tree, by their LFS sha256) are
    those of a newer commit up to T is left out, and so is a commit with no weight files (nothing to merge). At
    most `limit` (all when None): no search goes deeper than its bound (`choose`'s `attempts`), and each commit
    costs one listing. Every candidate's `how` is `inferred(before)`.

    InputUnavailable naming `repo_id`: the repository deleted or private, gated (its metadata says so and one of
    its weight files is refused), renamed (the Hub answers with another id: `renamed_to`), no commit at or before
    T (its history squashed away, or made after the merge), none up to T with weight files, the branch gone, or
    the Hub not answering (offline included)."""
    if before.tzinfo is None:
        raise ValueError("before: a time with its time zone (the Hub's dates are UTC)")
    if not hub.REVISION.fullmatch(branch):
        raise ValueError(f"{repo_id}: {branch!r} is not a branch name")
    if limit is not None and limit < 1:
        raise ValueError(f"limit: at least 1, not {limit}")
    from huggingface_hub import HfApi

    said, how = f"{repo_id}@{branch}", inferred(before)
    found: list[Candidate] = []
    try:
        with hub.guarded():
            api = HfApi()
            info = api.model_info(repo_id, revision=branch, timeout=hub.bounds()[0])
            if isinstance(info.id, str) and info.id.lower() != repo_id.lower():  # the Hub ids ignore case
                raise InputUnavailable(
                    f"input {repo_id}: the Hub answers for it with {info.id}: renamed (or moved) since the merge "
                    "named it, so its history may not be the one the merge read; give a copy of the commit the "
                    f"merge read with --input {repo_id}=COPY",
                    input=repo_id,
                    reason="renamed",
                    renamed_to=info.id,
                )
            history = api.list_repo_commits(repo_id, revision=branch)
            dated = [(_commit(c.commit_id, said), _utc(c.created_at, said)) for c in history]
            upto = sorted(((c, d) for c, d in dated if d <= before), key=lambda cd: cd[1], reverse=True)
            if not upto:
                squashed = _squashed(repo_id, branch, before, [d for _, d in dated])
                raise InputUnavailable(squashed, input=repo_id, reason="squashed")
            seen: set[str] = set()
            newest = ""  # a weight file of the newest candidate: what a gated repository is asked for
            for commit, date in upto:
                weights = _weights(api.list_repo_tree(repo_id, revision=commit))
                if not weights:
                    continue
                key = hashlib.sha256(json.dumps(sorted(weights.items())).encode()).hexdigest()
                if key not in seen:
                    seen.add(key)
                    found.append(Candidate(commit, date, key, how))
                    newest = newest or min(weights)
                if limit is not None and len(found) >= limit:
                    break
            if not found:
                raise InputUnavailable(
                    f"input {repo_id}: none of its {len(upto)} commits on {branch} up to {iso(before)} (when the "
                    "merge was published) holds weight files (*.safetensors, *.bin): nothing to reproduce it from",
                    input=repo_id,
                    reason="no-weights",
                )
            if info.gated:  # its listings are public; whether its files are is asked of one
                _readable(repo_id, found[0].commit, newest)
    except InputUnavailable:
        raise
    except Exception as error:
        raise _failed(said, error, repo_id) from error
    return found


def _weights(tree: Any) -> dict[str, str]:
    """A commit's weight files at the top of its tree: name -> LFS sha256 (a file not in LFS: its git blob id)."""
    found = {}
    for entry in tree:
        path = getattr(entry, "path", "")
        if "/" in path or not path.endswith(WEIGHT_SUFFIXES) or not hasattr(entry, "blob_id"):
            continue  # a folder, or a file mergekit does not read as weights
        lfs = getattr(entry, "lfs", None)
        found[path] = f"sha256:{lfs.sha256}" if lfs is not None else f"git:{entry.blob_id}"
    return found


def _readable(repo_id: str, commit: str, filename: str) -> None:
    """One weight file's headers asked for: a gated repository refuses them (GatedRepoError) unless granted."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=commit), timeout=hub.bounds()[0])


def _squashed(repo_id: str, branch: str, before: datetime, dates: list[datetime]) -> str:
    earliest = f"its earliest is of {iso(min(dates))}" if dates else "it has none"
    return (
        f"input {repo_id}: no commit on {branch} at or before {iso(before)}, when the merge was published "
        f"({earliest}): its history before then was squashed away, or it was made after the merge; give a copy of "
        f"the commit the merge read with --input {repo_id}=COPY"
    )


def _commit(said: Any, where: str) -> str:
    if isinstance(said, str) and hub.COMMIT.fullmatch(said):
        return said
    raise Unreadable(f"{where}: the Hub's history names {str(said)[:80]!r} as a commit id, not 40 hex digits")


def _utc(at: Any, where: str) -> datetime:
    if not isinstance(at, datetime) or at.tzinfo is None:
        raise Unreadable(f"{where}: the Hub's history gives {str(at)[:40]!r} as a commit's date, not a UTC time")
    return at.astimezone(timezone.utc)


def _failed(said: str, error: Exception, input_id: str | None) -> Unreadable:
    """Why the Hub gave no history, in one line naming `said`: InputUnavailable for an input, else Unreadable."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where, who = constants.ENDPOINT, f"input {said}" if input_id else said
    if isinstance(error, GatedRepoError):
        reason, line = "gated", f"a gated repository on {where}: ask for access on its page, log in (`hf auth login`)"
    elif isinstance(error, RepositoryNotFoundError):
        reason, line = "missing", f"no such model repository on {where}: deleted, or private (`hf auth login`)"
    elif isinstance(error, RevisionNotFoundError):
        reason, line = "no-revision", f"the repository on {where} has no revision {said.partition('@')[2]}"
    elif constants.HF_HUB_OFFLINE or isinstance(error, OfflineModeIsEnabled):
        reason, line = "unreachable", "HF_HUB_OFFLINE is set, so its history is not asked for (or give a copy: --input)"
    elif isinstance(error, Unreadable):  # the guard's: an answer that contradicts itself or the request
        reason, line = "unreachable", errors.said(error)
    else:
        reason, line = "unreachable", f"its history could not be read from {where} ({errors.said_with_type(error)})"
    message = f"{who}: {line}"
    if input_id is None:
        return Unreadable(message)
    return InputUnavailable(message, input=input_id, reason=reason)


# --------------------------------------------------------------------------- #
# Several unpinned inputs: which combination of their candidates
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Choice:
    """What `choose` found: `pins` (input -> commit) of the first combination that reproduced the merge, and
    `chosen` their candidates; or, `pins` None, the `reason` none was taken. `tried`: the combinations
    recomputed."""

    pins: dict[str, str] | None
    tried: int
    reason: str | None = None
    chosen: dict[str, Candidate] = field(default_factory=dict)


def choose(
    candidates: Mapping[str, Sequence[Candidate]],
    reproduces: Callable[[dict[str, str]], bool],
    *,
    attempts: int = ATTEMPTS,
) -> Choice:
    """The first combination of the inputs' candidates (each input's list newest first, as `candidates` gives it)
    for which `reproduces(pins)` (pins: input -> commit) is true, trying them newest first (`combinations`) and at
    most `attempts` of them. An error `reproduces` raises (an input unreadable) is not caught: the caller's."""
    if attempts < 1:
        raise ValueError(f"attempts: at least 1, not {attempts}")
    inputs = list(candidates)
    empty = [name for name in inputs if not candidates[name]]
    if empty:
        return Choice(None, 0, f"no candidate commit for {', '.join(empty)}")
    lengths = [len(candidates[name]) for name in inputs]
    total, tried = math.prod(lengths), 0
    for indices in itertools.islice(combinations(lengths), attempts):
        chosen = {name: candidates[name][i] for name, i in zip(inputs, indices, strict=True)}
        pins = {name: c.commit for name, c in chosen.items()}
        tried += 1
        if reproduces(pins):
            return Choice(pins, tried, None, chosen)
    counts = ", ".join(f"{name}: {n}" for name, n in zip(inputs, lengths, strict=True))
    if tried < total:
        reason = (
            f"none of the first {tried} of {total} combinations of the inputs' candidate commits ({counts}), newest "
            f"first, reproduces the merge (at most {attempts} are tried)"
        )
    else:
        reason = f"none of the {total} combinations of the inputs' candidate commits ({counts}) reproduces the merge"
    return Choice(None, tried, reason)


def combinations(lengths: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every tuple of candidate indices (one per input, below its `lengths`), newest first: by the sum of the
    indices (how far back, all inputs together), then by the largest (one input far back is less likely than
    each a little), then as tuples. Lazily, a sum at a time: the search stops long before the product."""
    if any(n < 1 for n in lengths):
        return
    for level in range(sum(n - 1 for n in lengths) + 1):
        yield from sorted(_summing(list(lengths), level), key=lambda t: (max(t, default=0), t))


def _summing(lengths: list[int], level: int) -> Iterator[tuple[int, ...]]:
    if not lengths:
        if level == 0:
            yield ()
        return
    rest = sum(n - 1 for n in lengths[1:])  # the most the other inputs can take
    for first in range(max(0, level - rest), min(lengths[0] - 1, level) + 1):
        for tail in _summing(lengths[1:], level - first):
            yield (first, *tail)
