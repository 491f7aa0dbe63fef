"""Installed versions of distributions, looked up one way: `--version`, the card, `ram_stats.json`, the guard."""

from __future__ import annotations

UNKNOWN = "unknown"


def installed(name: str) -> str:
    """The installed version of distribution `name`; "unknown" when it cannot be told."""
    from importlib import metadata  # looked up at call time: importing it costs start-up time

    try:
        return metadata.version(name)
    except Exception:  # not installed, or its metadata unreadable
        return UNKNOWN


def source(name: str) -> dict[str, str]:
    """Where the installed distribution `name` came from, as pip recorded it (PEP 610 `direct_url.json`):
    `git` (a repository URL) and `commit` for a VCS install; `checkout` and, when it is a git work tree,
    `commit` for an install from a folder (editable or not); `archive` and `sha256` for a wheel or sdist
    installed from a file (the hash when pip recorded one). {} when pip recorded nothing (an index install)."""
    import json
    import os
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    try:
        found = json.loads(metadata.distribution(name).read_text("direct_url.json") or "{}")
    except Exception:
        return {}
    url = str(found.get("url", ""))
    path = unquote(urlparse(url).path) if url.startswith("file://") else ""
    if "vcs_info" in found:
        vcs = found["vcs_info"]
        return {"git": url, **({"commit": str(vcs["commit_id"])} if vcs.get("commit_id") else {})}
    if "dir_info" in found and path:
        commit = _git_commit(path)
        return {"checkout": path, **({"commit": commit} if commit else {})}
    if "archive_info" in found:
        info = found["archive_info"]
        digest = (info.get("hashes") or {}).get("sha256") or str(info.get("hash", "")).removeprefix("sha256=")
        return {"archive": os.path.basename(path or url), **({"sha256": digest} if digest else {})}
    return {}


def _git_commit(folder: str) -> str | None:
    """The commit a git work tree's HEAD points at, read from its files (no git needed); None when unknown."""
    import os

    git = os.path.join(folder, ".git")
    try:
        if os.path.isfile(git):  # a worktree: "gitdir: PATH"
            with open(git, encoding="utf-8") as f:
                git = os.path.join(folder, f.read().split(":", 1)[1].strip())
        with open(os.path.join(git, "HEAD"), encoding="utf-8") as f:
            head = f.read().strip()
        if not head.startswith("ref: "):
            return head or None
        ref = head[5:]
        common = git
        if os.path.isfile(os.path.join(git, "commondir")):
            with open(os.path.join(git, "commondir"), encoding="utf-8") as f:
                common = os.path.join(git, f.read().strip())
        for root in (git, common):
            loose = os.path.join(root, ref)
            if os.path.isfile(loose):
                with open(loose, encoding="utf-8") as f:
                    return f.read().strip() or None
        with open(os.path.join(common, "packed-refs"), encoding="utf-8") as f:
            for line in f:
                if line.rstrip().endswith(" " + ref):
                    return line.split()[0]
    except (OSError, IndexError):
        return None
    return None
