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
    """Where the installed distribution `name` came from, as pip recorded it (PEP 610 `direct_url.json`), said
    without a local path: `installed_from` ("git", "checkout", "editable", "wheel", "sdist", "archive" or
    "index"); `url`, where a reader gets that code: the git URL or archive URL pip installed from when it is a
    network URL, else, for a git clone or checkout (a `file://` git URL is one), its `origin` remote when that is
    a network URL, else the project's declared Source URL (`declared_source`); `commit`; `changes`:
    "uncommitted" when an editable checkout differs from its commit (asked of git now: the code that runs is
    the checkout's), "unknown" for a folder installed without -e (pip records neither its commit nor its
    changes); `archive` (a file name) and `sha256`, and for a local archive `project_url`, the declared Source
    URL (the commit it was built from is not recorded)."""
    import json
    import os
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    try:
        dist = metadata.distribution(name)
        found = json.loads(dist.read_text("direct_url.json") or "{}")
    except Exception:  # not installed (run from a source tree on the path), or its metadata unreadable
        return {"installed_from": UNKNOWN}
    url = str(found.get("url", ""))
    local = unquote(urlparse(url).path) if url.startswith("file:") else ""
    subdirectory = f"#subdirectory={found['subdirectory']}" if found.get("subdirectory") else ""
    if "vcs_info" in found:
        commit = str(found["vcs_info"].get("commit_id") or "")
        where = public_url(url) if not local else _origin(local) or declared_source(dist)
        return _kept(installed_from="git", url=where and where + subdirectory, commit=commit)
    if "dir_info" in found and local:
        editable = bool(found["dir_info"].get("editable"))
        commit = _git_commit(local) or ""
        changes = (_changes(local) if editable else "unknown") if commit else ""
        where = (_origin(local) or declared_source(dist)) if commit else ""
        return _kept(
            installed_from="editable" if editable else "checkout",
            url=where and where + subdirectory,
            commit=commit,
            changes=changes,
        )
    if "archive_info" in found:
        info = found["archive_info"]
        digest = (info.get("hashes") or {}).get("sha256") or str(info.get("hash", "")).removeprefix("sha256=")
        file = os.path.basename(local or urlparse(url).path)
        kind = "wheel" if file.endswith(".whl") else "sdist" if file.endswith(SDISTS) else "archive"
        where = "" if local else public_url(url)
        return _kept(
            installed_from=kind,
            url=where,
            archive=file,
            sha256=digest,
            project_url="" if where else declared_source(dist),
        )
    return {"installed_from": "index"}


#: what an sdist's file name ends with
SDISTS = (".tar.gz", ".zip", ".tar.bz2", ".tar.xz", ".tgz")
#: the `[project.urls]` labels (PEP 753, normalised) that name where the source lies
SOURCE_LABELS = ("source", "sourcecode", "repository")


def declared_source(dist) -> str:
    """The project's declared source URL (`[project.urls]`: "Source" or "Repository"), when it is a network
    URL; "" when none is declared."""
    for entry in dist.metadata.get_all("Project-URL") or []:
        label, _, url = str(entry).partition(",")
        if "".join(c for c in label.lower() if c.isalnum()) in SOURCE_LABELS and public_url(url.strip()):
            return public_url(url.strip())
    return ""


def public_url(url: str) -> str:
    """`url` when it is a network URL a reader can fetch (https, http, ssh, git, or `user@host:path`), with no
    password or token (an ssh user kept, since ssh needs one); "" for a local one (`file:`, a path)."""
    from urllib.parse import urlsplit, urlunsplit

    url = url.strip().removeprefix("git+")
    if "://" not in url:
        host, sep, path = url.partition(":")
        if sep and "@" in host and "/" not in host and path:  # scp-like: git@host:org/repo.git
            url = f"ssh://{host}/{path.lstrip('/')}"
        else:
            return ""
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http", "ssh", "git") or not parts.hostname:
        return ""
    user = f"{parts.username}@" if parts.scheme == "ssh" and parts.username else ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit((parts.scheme, f"{user}{parts.hostname}{port}", parts.path, "", ""))


def _kept(**fields: str) -> dict[str, str]:
    return {key: value for key, value in fields.items() if value}


def _git(folder: str, *args: str) -> str | None:
    """What `git -C folder ARGS` prints; None when git is not there or fails."""
    import subprocess

    try:
        done = subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _origin(folder: str) -> str:
    """The network URL of a git work tree's `origin` remote; "" when it has none, or a local one."""
    return public_url(_git(folder, "remote", "get-url", "origin") or "")


def _changes(folder: str) -> str:
    """ "uncommitted" when a git work tree differs from its commit (files changed, added or untracked), ""
    when it does not, "unknown" when git cannot say."""
    status = _git(folder, "status", "--porcelain")
    return "unknown" if status is None else "uncommitted" if status.strip() else ""


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
