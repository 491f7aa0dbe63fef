"""`mergekit-ram verify ORG/NAME[@REVISION]`: a merge published on the Hugging Face Hub, fetched for verify.

Only the files verify reads or names are fetched, into the Hub cache, at the commit the revision names when
asked (the verdict records it): `ram_stats.json`, `mergekit_config.yml`, the card, the config, the files beside
the weights a loader reads (tokenizer, generation config, a PEFT adapter, named chat templates) and the weight
files each loader reads (a single file, an index and every shard it names). Never code: a `.py` file on the
Hub is named from the repository's listing, unfetched, and so is every other file no loader reads. verify
then reads the snapshot folder as any folder (`folder_checks.homes` accepts its links into the cache's blobs).
The Hub offline (`HF_HUB_OFFLINE`), unreachable, or without the repository or revision: `Unreadable` in
one line (verify's exit 3); a repository without `ram_stats.json`: `NotVerifiable` (exit 2, as for a folder).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mergekit_ram.checks import output_checks
from mergekit_ram.errors import NotVerifiable, Unreadable
from mergekit_ram.verify import folder_checks, loader_files

#: what verify reads beside the weights, by name (the weights: `loader_files.SINGLE`, `PICKLED` and their indexes)
RECORDS = (output_checks.STATS_FILE, "mergekit_config.yml", "README.md", "config.json")


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
    Unreadable, in one line, when the Hub cannot say or give them."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    said = f"{repository}@{requested}"
    if constants.HF_HUB_OFFLINE:
        raise Unreadable(
            f"{said}: HF_HUB_OFFLINE is set, so the Hub is not asked for its files; verify a downloaded copy "
            "instead (mergekit-ram verify FOLDER)"
        )
    shown = are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    try:
        info = HfApi().model_info(repository, revision=requested)
        commit = str(info.sha)
        listed = sorted(s.rfilename for s in info.siblings or [])
        if output_checks.STATS_FILE not in listed:  # as a folder without it: a usage error
            raise NotVerifiable(
                f"{said} (commit {commit}) holds no {output_checks.STATS_FILE}: not the output of a finished "
                "ramplus merge"
            )
        left = [name for name in listed if wanted(name) and not weights and _weight(name)]
        first = [name for name in listed if wanted(name) and name not in left]
        folder = _download(repository, commit, first, cache_dir)
        shards = {
            name
            for choice in loader_files.loader_choices(folder).values()
            if choice.endswith(".index.json")
            for name in loader_files.weight_files(folder, choice)
        }
        more = sorted(shards & set(listed) - set(first) - {n for n in shards if loader_files.is_code(n)})
        left, more = (left, more) if weights else (sorted({*left, *more}), [])
        if more:
            _download(repository, commit, more, cache_dir)
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


def _download(repository: str, commit: str, names: list[str], cache_dir: str | None) -> str:
    """`names` of `repository` at `commit`, each matched exactly (glob characters escaped); the snapshot folder."""
    import glob

    from huggingface_hub import snapshot_download

    patterns = [glob.escape(name) for name in names]
    return str(snapshot_download(repository, revision=commit, allow_patterns=patterns, cache_dir=cache_dir))


def _why(said: str, error: Exception, endpoint: str) -> str:
    """One line: why the Hub gave no files."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(error, GatedRepoError):
        return f"{said}: a gated repository on {endpoint}: ask for access on its page and log in (`hf auth login`)"
    if isinstance(error, RepositoryNotFoundError):
        return f"{said}: no such model repository on {endpoint} (a private one needs `hf auth login`)"
    if isinstance(error, RevisionNotFoundError):
        return f"{said}: the repository on {endpoint} has no revision {said.partition('@')[2]}"
    detail = " ".join(str(error).split())[:200]
    return f"{said}: the Hub at {endpoint} could not be asked ({type(error).__name__}: {detail})"
